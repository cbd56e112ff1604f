"""Hidden states leave the scheduler as one host copy per batch, and reach the caller as
arrays or, by default, as the lists of before (0.5.23's return-hidden-states-arrays).

SGLang 0.5.23's result processor called ``.cpu()`` on each request's rows of a forward
(``_append_prefill_hidden_states`` / ``_append_decode_hidden_states``; on a GPU a
synchronous copy each) and ``.tolist()`` on them, so the rows crossed the scheduler ->
detokenizer -> tokenizer-manager pipes as pickled Python floats: the cost of
``--enable-return-aux-hidden-states`` (a draft trainer's features) and of
``return_hidden_states``. With the patch:

* every request's rows of a forward are planned into a ``ReturnedHiddenStates``, which
  gathers them in one ``index_select`` and copies them to the host once; each request
  keeps a host tensor of its own rows (not a view that keeps the forward's tensor);
* the tokenizer manager hands the caller one tensor per request
  (``return_raw_hidden_states``, the Engine's new argument), else the nested lists of
  before, made there once; the HTTP server refuses the raw form (no JSON for a tensor).

Here SGLang's own ``Req``, result-processor methods and tokenizer-manager function; the
real Engine's rows, both forms against each other and against transformers, are
``tests/e2e/test_features.py::test_raw_rows_equal_list_rows``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("return-hidden-states-arrays")

WIDTH = 6


def _req(mode, rid="r", n=19):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", list(range(n)), SamplingParams(), return_hidden_states=mode)


def _processor():
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    return SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)


def _rows(n, dtype=None):
    import torch

    return torch.arange(n * WIDTH, dtype=dtype or torch.float32).reshape(n, WIDTH) / 7


class _CountOps:
    """A TorchDispatchMode counting the ops run on tensors (by name)."""

    def __enter__(self):
        import collections

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _prefill_batch(reqs, lengths, rows):
    """Three requests' rows of one extend forward, through the loop's calls."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.scheduler_components.batch_result_processor import ReturnedHiddenStates
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    proc, returned = _processor(), ReturnedHiddenStates()
    output = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows)
    offset = 0
    for req, n in zip(reqs, lengths):
        offset = proc._append_prefill_hidden_states(
            req=req, logits_output=output, hidden_state_offset=offset,
            capture_hidden_mode=CaptureHiddenMode.FULL, extend_input_len=n, store=True,
            returned=returned)
    with _CountOps() as ops:
        returned.copy_to_host(rows)
    return ops.counts


@GUARD
def test_prefill_rows_one_gather_and_tensors_of_their_own():
    import torch

    lengths = (5, 3, 7)
    reqs = [_req(True, "a"), _req(False, "b"), _req(True, "c")]
    rows = _rows(sum(lengths))
    counts = _prefill_batch(reqs, lengths, rows)
    assert counts["index_select"] == 1, f"ops per batch: {dict(counts)}"
    assert not counts["clone"] and not counts["_to_copy"], dict(counts)
    (a,), b, (c,) = reqs[0].hidden_states, reqs[1].hidden_states, reqs[2].hidden_states
    assert b == []
    for got, want in ((a, rows[:5]), (c, rows[8:15])):
        assert isinstance(got, torch.Tensor), f"a {type(got).__name__}, not a tensor"
        assert torch.equal(got, want)
    owner = rows.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != owner, "the request keeps the forward's tensor alive"


@GUARD
def test_one_request_is_one_copy_not_a_view():
    import torch

    req, rows = _req(True), _rows(4)
    counts = _prefill_batch([req], (4,), rows)
    assert counts["clone"] == 1 and not counts["index_select"], dict(counts)
    (got,) = req.hidden_states
    assert torch.equal(got, rows) and got.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()


@GUARD
@pytest.mark.parametrize("mode", [True, "last"])
def test_decode_rows_are_host_tensors(mode):
    """A speculative decode step: two requests, a stride of 4 rows each, 3 and 2 of them
    accepted; "last" keeps only the last accepted row."""
    import torch

    from sglang.srt.managers.scheduler_components.batch_result_processor import ReturnedHiddenStates

    proc = _processor()
    rows = _rows(8, torch.bfloat16)
    reqs = [_req(mode, "a"), _req(mode, "b")]
    returned = ReturnedHiddenStates()
    for i, (req, accept) in enumerate(zip(reqs, (3, 2))):
        req.output_ids.extend([1] * accept)
        proc._append_decode_hidden_states(req=req, hidden_states=rows, start=4 * i,
                                          accept_len=accept, returned=returned)
    assert all(r.hidden_states == [] for r in reqs), "copied before the batch's one copy"
    with _CountOps() as ops:
        returned.copy_to_host(rows)
    assert ops.counts["index_select"] == 1, dict(ops.counts)
    want = ([rows[0], rows[1], rows[2]], [rows[4], rows[5]]) if mode is True else ([rows[2]], [rows[5]])
    for req, expected in zip(reqs, want):
        assert len(req.hidden_states) == len(expected)
        for got, row in zip(req.hidden_states, expected):
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and torch.equal(got, row)


def _finished(mode, entries, rid):
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    # Three generated tokens: the prompt's entry, then a row for each generated token
    # that a forward took as input (the output streamer keeps finished_len entries).
    req = Req(rid, "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=3), return_hidden_states=mode)
    req.output_ids.extend([5, 6, 7])
    req.finished_reason = FINISH_LENGTH(3)
    req.hidden_states = list(entries)
    return req


def _payload(reqs):
    """The scheduler's output for ``reqs`` (SGLang's own accumulator, as
    ``stream_output`` builds it)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    acc = _GenerationStreamAccumulator(
        return_logprob=False, return_hidden_states=True, return_routed_experts=False,
        return_indexer_topk=False, spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL, default_stream_interval=1,
        default_force_stream_interval=0, get_cached_tokens_details=lambda r: None,
        is_request_level_customized_info_key=lambda k: False, current_weight_version="default")
    for req in reqs:
        acc.accept(req=req)
    return acc.to_payload(dp_rank=0, is_idle_batch=False)


@GUARD
def test_one_array_per_request_across_the_pipes():
    """What the scheduler sends: per request one host tensor of all its rows and their
    layout, not a Python float (or a tensor) per row; both IPC encodings (pickle, and
    msgpack with SGLang's hooks, typed as the fields are) carry them unchanged."""
    import pickle

    import msgspec
    import torch

    from sglang.srt.managers import io_struct
    from sglang.srt.utils.msgpack_utils import dec_hook, enc_hook, ext_hook

    rows = _rows(7, torch.bfloat16)
    reqs = [_finished(True, [rows[:5], rows[5], rows[6]], "full"), _finished("last", [rows[6]], "last"),
            _finished(False, [], "none")]
    payload = _payload(reqs)
    got, layout = payload.output_hidden_states, payload.output_hidden_states_layout
    assert isinstance(got[0], torch.Tensor) and torch.equal(got[0], rows), got[0]
    assert layout[0] == [5, -1, -1]
    assert torch.equal(got[1], rows[6]) and layout[1] is None
    assert got[2] is None and layout[2] is None
    again = pickle.loads(pickle.dumps(payload))
    assert torch.equal(again.output_hidden_states[0], rows)
    encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
    for kind, value in ((io_struct.OutputHiddenStates, got), (io_struct.HiddenStatesLayout, layout)):
        back = msgspec.msgpack.Decoder(kind, dec_hook=dec_hook, ext_hook=ext_hook).decode(encoder.encode(value))
        assert len(back) == len(value)
    back = msgspec.msgpack.Decoder(io_struct.OutputHiddenStates, dec_hook=dec_hook,
                                   ext_hook=ext_hook).decode(encoder.encode(got))
    assert back[0].dtype == torch.bfloat16 and torch.equal(back[0], rows)


@GUARD
def test_the_pickle_ipc_sends_a_cpu_tensor_as_its_bytes(monkeypatch):
    """SGLang's ``sock_send`` (the pickle IPC, the default) over a real zmq pipe: a CPU
    tensor crosses as its bytes, dtype and shape (as the msgpack IPC's ``enc_hook`` sends
    it), not through torch's legacy storage pickling, several times slower per tensor;
    a view sends its own elements, not its base's storage; ``sock_recv`` gives back
    equal tensors, dtype and shape kept; other tensors pickle as before."""
    import pickle

    import torch
    import zmq

    from sglang.srt.managers import io_struct

    monkeypatch.setattr(io_struct, "_USE_PICKLE_IPC", True)
    base = torch.arange(4096 * WIDTH, dtype=torch.float32).reshape(4096, WIDTH) / 7
    tensors = [_rows(7, torch.bfloat16), base[5:8], base[::2, 1], torch.tensor(2.5),
               torch.empty(0, WIDTH), torch.tensor([True, False]),
               torch.ones(2, requires_grad=True)]
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://ipc-tensors")
        b.connect("inproc://ipc-tensors")
        io_struct.sock_send(a, {"rows": tensors[:6]})
        wire = b.recv()
        io_struct.sock_send(a, {"rows": tensors})
        back = io_struct.sock_recv(b)["rows"]
    finally:
        a.close(0), b.close(0), ctx.term()
    assert b"_rebuild_tensor" not in wire, "a CPU tensor went through torch's storage pickling"
    assert len(wire) < base.nbytes // 4, f"a view sent its base's storage: {len(wire)} bytes"
    assert [t.dtype for t in pickle.loads(wire)["rows"]] == [t.dtype for t in tensors[:6]]
    for t, u in zip(tensors, back):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t.detach()), (t, u)
    assert back[-1].requires_grad


@GUARD
def test_caller_gets_the_lists_of_before_or_one_tensor():
    """What ``meta_info["hidden_states"]`` holds: by default the nested lists pristine
    0.5.23 returned (the prompt's rows as one entry, a row per generated token), value
    for value; with ``return_raw_hidden_states`` one tensor in the captured dtype."""
    import torch

    from sglang.srt.managers import io_struct, tokenizer_manager

    rows = _rows(7, torch.bfloat16)
    packed, layout = io_struct.pack_hidden_states([rows[:5], rows[5], rows[6]])
    before = [rows[:5].tolist(), rows[5].tolist(), rows[6].tolist()]
    assert tokenizer_manager._hidden_states_for_caller(packed, layout, raw=False) == before
    raw = tokenizer_manager._hidden_states_for_caller(packed, layout, raw=True)
    assert isinstance(raw, torch.Tensor) and raw.dtype == torch.bfloat16 and torch.equal(raw, rows)
    assert tokenizer_manager._hidden_states_for_caller(rows[6], None, raw=False) == rows[6].tolist()
    assert torch.equal(tokenizer_manager._hidden_states_for_caller(rows[6], None, raw=True), rows[6])
    assert tokenizer_manager._hidden_states_for_caller(None, [], raw=False) == []


@GUARD
def test_the_option_reaches_every_request_of_a_batch_and_the_engine():
    import inspect

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=[[1, 2], [3]], return_hidden_states=True, return_raw_hidden_states=True)
    obj.normalize_batch_and_arguments()
    assert obj[0].return_raw_hidden_states and obj[1].return_raw_hidden_states
    for method in (Engine.generate, Engine.async_generate):
        assert inspect.signature(method).parameters["return_raw_hidden_states"].default is False


@GUARD
def test_http_refuses_the_raw_form():
    """A tensor has no JSON form: over HTTP the request is refused in one line."""
    import asyncio
    import json

    from starlette.requests import Request

    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = {"input_ids": [1, 2], "return_hidden_states": True, "return_raw_hidden_states": True}
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/generate", "headers": [],
                       "query_string": b""}, receive)
    response = asyncio.run(http_server.generate_request(GenerateReqInput(**body), request))
    assert response.status_code == 400
    message = json.loads(response.body)["error"]
    assert "return_raw_hidden_states" in message and "\n" not in message
