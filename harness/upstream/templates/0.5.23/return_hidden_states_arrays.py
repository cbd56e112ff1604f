# upstream-path: test/registered/unit/managers/test_returned_hidden_states.py
"""Hidden states leave the scheduler as one host copy per batch and reach the caller
as the lists of before, or as one tensor per request (return_raw_hidden_states).

The result processor used to call .cpu() and .tolist() on each request's rows of
every forward, so every value crossed the scheduler -> detokenizer -> tokenizer
manager pipes as a Python float. Each case drives SGLang's own code: the result
processor's methods over a batch of prefill and decode rows, the output streamer's
payload, both IPC encodings, the tokenizer manager's conversion, the Engine's
signature and the HTTP server's refusal of the raw form.

Runs on CPU without a GPU or a model.
"""

import asyncio
import collections
import inspect
import json
import pickle
import unittest
from array import array

import msgspec
import torch
import zmq
from starlette.requests import Request
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints import http_server
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers import io_struct, tokenizer_manager
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.output_streamer import (
    _GenerationStreamAccumulator,
)
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils.msgpack_utils import dec_hook, enc_hook, ext_hook
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

WIDTH = 6


def _rows(n, dtype=torch.float32):
    return torch.arange(n * WIDTH, dtype=dtype).reshape(n, WIDTH) / 7


def _req(mode, rid="r"):
    return Req(rid, "", list(range(19)), SamplingParams(), return_hidden_states=mode)


def _processor():
    return SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _finished(mode, entries, rid):
    req = Req(
        rid,
        "",
        array("q", [1, 2, 3]),
        SamplingParams(max_new_tokens=3),
        return_hidden_states=mode,
    )
    req.output_ids.extend([5, 6, 7])
    req.finished_reason = FINISH_LENGTH(3)
    req.hidden_states = list(entries)
    return req


def _payload(reqs):
    acc = _GenerationStreamAccumulator(
        return_logprob=False,
        return_hidden_states=True,
        return_routed_experts=False,
        return_indexer_topk=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL,
        default_stream_interval=1,
        default_force_stream_interval=0,
        get_cached_tokens_details=lambda r: None,
        is_request_level_customized_info_key=lambda k: False,
        current_weight_version="default",
    )
    for req in reqs:
        acc.accept(req=req)
    return acc.to_payload(dp_rank=0, is_idle_batch=False)


class TestReturnedHiddenStates(CustomTestCase):
    def test_prefill_rows_one_gather_and_host_tensors_of_their_own(self):
        from sglang.srt.managers.scheduler_components.batch_result_processor import (
            ReturnedHiddenStates,
        )

        lengths = (5, 3, 7)
        reqs = [_req(True, "a"), _req(False, "b"), _req(True, "c")]
        rows = _rows(sum(lengths))
        proc, returned = _processor(), ReturnedHiddenStates()
        output = LogitsProcessorOutput(next_token_logits=None, hidden_states=rows)
        offset = 0
        for req, n in zip(reqs, lengths):
            offset = proc._append_prefill_hidden_states(
                req=req,
                logits_output=output,
                hidden_state_offset=offset,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                extend_input_len=n,
                store=True,
                returned=returned,
            )
        with _CountOps() as ops:
            returned.copy_to_host(rows)
        self.assertEqual(ops.counts["index_select"], 1)
        self.assertEqual(reqs[1].hidden_states, [])
        for req, want in ((reqs[0], rows[:5]), (reqs[2], rows[8:15])):
            (got,) = req.hidden_states
            self.assertIsInstance(got, torch.Tensor)
            self.assertTrue(torch.equal(got, want))
            self.assertNotEqual(
                got.untyped_storage().data_ptr(), rows.untyped_storage().data_ptr()
            )

    def test_decode_rows_are_host_tensors(self):
        for mode in (True, "last"):
            with self.subTest(mode=mode):
                rows = _rows(8, torch.bfloat16)
                reqs = [_req(mode, "a"), _req(mode, "b")]
                for i, (req, accept) in enumerate(zip(reqs, (3, 2))):
                    req.output_ids.extend([1] * accept)
                    SchedulerBatchResultProcessor._append_decode_hidden_states(
                        req=req, hidden_states=rows, start=4 * i, accept_len=accept
                    )
                if mode is True:
                    want = ([rows[0], rows[1], rows[2]], [rows[4], rows[5]])
                else:
                    want = ([rows[2]], [rows[5]])
                for req, expected in zip(reqs, want):
                    self.assertEqual(len(req.hidden_states), len(expected))
                    for got, row in zip(req.hidden_states, expected):
                        self.assertIsInstance(got, torch.Tensor)
                        self.assertEqual(got.dtype, torch.bfloat16)
                        self.assertTrue(torch.equal(got, row))

    def test_one_array_per_request_across_the_pipes(self):
        rows = _rows(7, torch.bfloat16)
        payload = _payload(
            [
                _finished(True, [rows[:5], rows[5], rows[6]], "full"),
                _finished("last", [rows[6]], "last"),
                _finished(False, [], "none"),
            ]
        )
        got, layout = payload.output_hidden_states, payload.output_hidden_states_layout
        self.assertTrue(torch.equal(got[0], rows))
        self.assertEqual(layout[0], [5, -1, -1])
        self.assertTrue(torch.equal(got[1], rows[6]))
        self.assertIsNone(layout[1])
        self.assertIsNone(got[2])
        again = pickle.loads(pickle.dumps(payload))
        self.assertTrue(torch.equal(again.output_hidden_states[0], rows))
        encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
        back = msgspec.msgpack.Decoder(
            io_struct.OutputHiddenStates, dec_hook=dec_hook, ext_hook=ext_hook
        ).decode(encoder.encode(got))
        self.assertEqual(back[0].dtype, torch.bfloat16)
        self.assertTrue(torch.equal(back[0], rows))
        back_layout = msgspec.msgpack.Decoder(io_struct.HiddenStatesLayout).decode(
            encoder.encode(layout)
        )
        self.assertEqual(back_layout, layout)

    def test_pickle_ipc_sends_a_cpu_tensor_as_its_bytes(self):
        base = torch.arange(4096 * WIDTH, dtype=torch.float32).reshape(4096, WIDTH)
        tensors = [
            _rows(7, torch.bfloat16),
            base[5:8],
            base[::2, 1],
            torch.tensor(2.5),
            torch.empty(0, WIDTH),
            torch.ones(2, requires_grad=True),
        ]
        ctx = zmq.Context()
        sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        saved, io_struct._USE_PICKLE_IPC = io_struct._USE_PICKLE_IPC, True
        try:
            sender.bind("inproc://ipc-tensors")
            receiver.connect("inproc://ipc-tensors")
            io_struct.sock_send(sender, {"rows": tensors[:5]})
            wire = receiver.recv()
            io_struct.sock_send(sender, {"rows": tensors})
            back = io_struct.sock_recv(receiver)["rows"]
        finally:
            io_struct._USE_PICKLE_IPC = saved
            sender.close(0)
            receiver.close(0)
            ctx.term()
        self.assertNotIn(b"_rebuild_tensor", wire)
        self.assertLess(len(wire), base.nbytes // 4)
        for t, u in zip(tensors, back):
            self.assertEqual((u.dtype, u.shape), (t.dtype, t.shape))
            self.assertTrue(torch.equal(u, t.detach()))
        self.assertTrue(back[-1].requires_grad)

    def test_caller_gets_the_lists_of_before_or_one_tensor(self):
        rows = _rows(7, torch.bfloat16)
        packed, layout = io_struct.pack_hidden_states([rows[:5], rows[5], rows[6]])
        before = [rows[:5].tolist(), rows[5].tolist(), rows[6].tolist()]
        to_caller = tokenizer_manager._hidden_states_for_caller
        self.assertEqual(to_caller(packed, layout, raw=False), before)
        raw = to_caller(packed, layout, raw=True)
        self.assertEqual(raw.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(raw, rows))
        self.assertEqual(to_caller(rows[6], None, raw=False), rows[6].tolist())
        self.assertTrue(torch.equal(to_caller(rows[6], None, raw=True), rows[6]))

    def test_the_option_reaches_every_request_and_the_engine(self):
        obj = GenerateReqInput(
            input_ids=[[1, 2], [3]],
            return_hidden_states=True,
            return_raw_hidden_states=True,
        )
        obj.normalize_batch_and_arguments()
        self.assertTrue(obj[0].return_raw_hidden_states)
        self.assertTrue(obj[1].return_raw_hidden_states)
        for method in (Engine.generate, Engine.async_generate):
            param = inspect.signature(method).parameters["return_raw_hidden_states"]
            self.assertIs(param.default, False)

    def test_http_refuses_the_raw_form(self):
        body = {
            "input_ids": [1, 2],
            "return_hidden_states": True,
            "return_raw_hidden_states": True,
        }
        raw = json.dumps(body).encode()

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/generate",
            "headers": [],
            "query_string": b"",
        }
        response = asyncio.run(
            http_server.generate_request(
                GenerateReqInput(**body), Request(scope, receive)
            )
        )
        self.assertEqual(response.status_code, 400)
        self.assertIn("return_raw_hidden_states", json.loads(response.body)["error"])


if __name__ == "__main__":
    unittest.main()
