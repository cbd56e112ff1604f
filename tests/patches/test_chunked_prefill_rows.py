"""A prompt prefilled in chunks gets a hidden-state row for every token it computed
(0.5.23's return-aux-chunked-prefill-rows).

SGLang 0.5.23 commits a request's prefill output only once no middle chunk is in
flight (``batch_result_processor.py``: ``should_commit_output`` needs
``inflight_middle_chunks <= 0``), and ``_append_prefill_hidden_states`` kept a forward's
rows only when it commits: ``return_hidden_states`` (and with it
``--enable-return-aux-hidden-states``, the features a draft trainer gets) handed back the
last chunk's rows only. Here SGLang's own ``Req`` and result processor's method get the
rows of each chunk as ``process_batch_result_prefill`` passes them: the scheduler's
``inflight_middle_chunks`` accounting (one more per scheduled middle chunk, one less per
processed one) and the loop's ``store`` rule. The real Engine's rows, against
transformers, are ``tests/e2e/test_features.py::test_chunked_prompt_every_row``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("return-aux-chunked-prefill-rows")

WIDTH = 6


def _req(mode):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req("r", "", list(range(19)), SamplingParams(), return_hidden_states=mode)


def _processor():
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    return SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)


def _prefill(req, rows, chunks, mode="full", last=True):
    """Process one prefill forward per chunk of ``rows`` as the scheduler does: a chunk
    before the prompt's last is scheduled with ``inflight_middle_chunks`` raised and
    processed without committing (``store=False``), then lowered; the last one (when
    ``last``) commits."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    capture = CaptureHiddenMode.FULL if mode == "full" else CaptureHiddenMode.LAST
    proc, start = _processor(), 0
    for i, n in enumerate(chunks):
        middle = i < len(chunks) - 1 or not last
        req.inflight_middle_chunks += int(middle)
        chunk = rows[start:start + n]
        output = LogitsProcessorOutput(
            next_token_logits=None,
            hidden_states=chunk if capture.is_full() else chunk[-1:],
        )
        store = not req.finished() and not req.is_retracted and req.inflight_middle_chunks <= 0
        proc._append_prefill_hidden_states(
            req=req, logits_output=output, hidden_state_offset=0,
            capture_hidden_mode=capture, extend_input_len=n if capture.is_full() else 1,
            store=store,
        )
        req.inflight_middle_chunks -= int(middle)
        start += n


def _values(entries):
    """``req.hidden_states`` as plain lists: its entries are lists of floats, or host
    tensors once return-hidden-states-arrays keeps them as arrays."""
    return [e.tolist() if hasattr(e, "tolist") else e for e in entries]


def _rows(n=19):
    import torch

    return torch.arange(n * WIDTH, dtype=torch.float32).reshape(n, WIDTH)


@GUARD
@pytest.mark.parametrize("chunks", [(8, 8, 3), (8, 11), (1,) * 19], ids=["8-8-3", "8-11", "ones"])
def test_every_chunk_rows_returned(chunks):
    req, rows = _req(True), _rows()
    _prefill(req, rows, chunks)
    assert len(req.hidden_states) == 1, f"{len(req.hidden_states)} prefill entries for one prompt"
    assert _values(req.hidden_states)[0] == rows.tolist(), (
        f"chunks {chunks}: {len(req.hidden_states[0])} rows back for a prompt of {len(rows)}")


def test_one_chunk_unchanged():
    req, rows = _req(True), _rows()
    _prefill(req, rows, (19,))
    assert _values(req.hidden_states) == [rows.tolist()]


@pytest.mark.parametrize("mode", ["full", "last"])
def test_last_mode_keeps_the_prompts_last_row(mode):
    req, rows = _req("last"), _rows()
    _prefill(req, rows, (8, 8, 3), mode)
    assert _values(req.hidden_states) == [rows[-1].tolist()]


@GUARD
def test_retracted_request_starts_over():
    """A request retracted after a middle chunk is prefilled again from its first token:
    the rows of the chunk before the retraction do not come back twice."""
    req, rows = _req(True), _rows()
    _prefill(req, rows, (8,), last=False)
    req.reset_for_retract()
    req.is_retracted = False
    _prefill(req, rows, (8, 8, 3))
    assert _values(req.hidden_states) == [rows.tolist()]


def test_aborted_between_chunks_returns_nothing():
    """A request aborted while a middle chunk is in flight: that chunk's result is
    processed (the accounting drains) and nothing is returned or kept."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req, rows = _req(True), _rows()
    _prefill(req, rows, (8,), last=False)
    req.finished_reason = FINISH_ABORT("aborted")
    _prefill(req, rows[8:], (8,), last=False)
    assert req.hidden_states == []
    assert not getattr(req, "chunked_prefill_hidden_states", [])
