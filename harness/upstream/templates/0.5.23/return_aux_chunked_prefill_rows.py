# upstream-path: test/registered/unit/managers/test_chunked_prefill_hidden_states.py
"""A prompt prefilled in chunks gets a hidden-state row for every token it
computed.

process_batch_result_prefill commits a request's output only once no middle
chunk is in flight, and _append_prefill_hidden_states used to store a
forward's rows only then: return_hidden_states (and
--enable-return-aux-hidden-states) handed back the prompt's last chunk only.
Each case feeds SGLang's Req and _append_prefill_hidden_states one forward
per chunk, as the result loop does: inflight_middle_chunks raised while a
middle chunk is scheduled, store only when the request commits.

Runs on CPU without a GPU or a model.
"""

import unittest

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.managers.scheduler_components.batch_result_processor import (
    SchedulerBatchResultProcessor,
)
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

PROMPT_LEN = 19
WIDTH = 6


def _req(mode=True):
    return Req(
        "r", "", list(range(PROMPT_LEN)), SamplingParams(), return_hidden_states=mode
    )


def _values(entries):
    # A request's entries, as lists of floats whether they are kept as lists or as
    # host tensors.
    return [e.tolist() if isinstance(e, torch.Tensor) else e for e in entries]


def _rows():
    return torch.arange(PROMPT_LEN * WIDTH, dtype=torch.float32).view(PROMPT_LEN, -1)


def _prefill(req, rows, chunks, capture=CaptureHiddenMode.FULL, last=True):
    processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
    start = 0
    for i, n in enumerate(chunks):
        middle = i < len(chunks) - 1 or not last
        req.inflight_middle_chunks += int(middle)
        chunk = rows[start : start + n]
        out = LogitsProcessorOutput(
            next_token_logits=None,
            hidden_states=chunk if capture.is_full() else chunk[-1:],
        )
        store = (
            not req.finished()
            and not req.is_retracted
            and req.inflight_middle_chunks <= 0
        )
        processor._append_prefill_hidden_states(
            req=req,
            logits_output=out,
            hidden_state_offset=0,
            capture_hidden_mode=capture,
            extend_input_len=n if capture.is_full() else 1,
            store=store,
        )
        req.inflight_middle_chunks -= int(middle)
        start += n


class TestChunkedPrefillHiddenStates(CustomTestCase):
    def test_every_chunk_rows_returned(self):
        for chunks in ((19,), (8, 8, 3), (8, 11), (1,) * PROMPT_LEN):
            with self.subTest(chunks=chunks):
                req, rows = _req(), _rows()
                _prefill(req, rows, chunks)
                self.assertEqual(_values(req.hidden_states), [rows.tolist()])

    def test_last_mode_returns_the_prompts_last_row(self):
        for capture in (CaptureHiddenMode.FULL, CaptureHiddenMode.LAST):
            with self.subTest(capture=capture):
                req, rows = _req("last"), _rows()
                _prefill(req, rows, (8, 8, 3), capture)
                self.assertEqual(_values(req.hidden_states), [rows[-1].tolist()])

    def test_retraction_starts_the_prompt_over(self):
        req, rows = _req(), _rows()
        _prefill(req, rows, (8,), last=False)
        req.reset_for_retract()
        req.is_retracted = False
        _prefill(req, rows, (8, 8, 3))
        self.assertEqual(_values(req.hidden_states), [rows.tolist()])

    def test_abort_between_chunks_returns_nothing(self):
        req, rows = _req(), _rows()
        _prefill(req, rows, (8,), last=False)
        req.finished_reason = FINISH_ABORT("aborted")
        _prefill(req, rows[8:], (8,), last=False)
        self.assertEqual(req.hidden_states, [])


if __name__ == "__main__":
    unittest.main()
