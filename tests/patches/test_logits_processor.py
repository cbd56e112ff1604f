"""LogitsProcessor accepts packed aux hidden states as well as the list (patch
aux-packer), in every path that touches them, through the real forward()."""

from __future__ import annotations

import pytest
import torch

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

GUARD = pytest.mark.guards("aux-packer")
H, K, V = 16, 3, 64


@pytest.fixture(scope="module")
def lp(sglang_tp1):
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from transformers import PretrainedConfig

    config = PretrainedConfig(vocab_size=V, hidden_size=H)
    head = ParallelLMHead(V, H)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=torch.Generator().manual_seed(3)))
    return LogitsProcessor(config), head


def _metadata(case, capture):
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardMode,
    )

    mode = {"full": CaptureHiddenMode.FULL, "last": CaptureHiddenMode.LAST}[capture]
    if case == "decode":
        return LogitsMetadata(forward_mode=ForwardMode.DECODE, capture_hidden_mode=mode), 4
    if case == "idle":
        return LogitsMetadata(forward_mode=ForwardMode.IDLE, capture_hidden_mode=mode), 0
    lens = [3, 5, 2]
    if case == "extend":
        return (
            LogitsMetadata(
                forward_mode=ForwardMode.EXTEND,
                capture_hidden_mode=mode,
                extend_seq_lens=torch.tensor(lens),
                extend_seq_lens_cpu=lens,
            ),
            sum(lens),
        )
    if case == "extend-logprob":
        starts = [0, 5, 1]
        return (
            LogitsMetadata(
                forward_mode=ForwardMode.EXTEND,
                capture_hidden_mode=mode,
                extend_return_logprob=True,
                extend_seq_lens=torch.tensor(lens),
                extend_seq_lens_cpu=lens,
                extend_logprob_start_lens_cpu=starts,
                extend_logprob_pruned_lens_cpu=[l - s for l, s in zip(lens, starts)],
            ),
            sum(lens),
        )
    raise ValueError(case)


def _expected_rows(case, capture, n):
    """Rows of the [n, K*H] aux states that the processor must return."""
    if capture == "full" or case in ("decode", "idle"):
        return torch.arange(n)
    lens = [3, 5, 2]
    ends = torch.cumsum(torch.tensor(lens), 0) - 1
    return ends  # last token of each sequence


CASES = ["decode", "idle", "extend", "extend-logprob"]


@GUARD
@pytest.mark.parametrize("capture", ["full", "last"])
@pytest.mark.parametrize("case", CASES)
def test_packed_and_list_agree(lp, case, capture):
    proc, head = lp
    md, n = _metadata(case, capture)
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, H, generator=g)
    caps = [torch.randn(n, H, generator=g) for _ in range(K)]
    packed = torch.cat(caps, dim=-1)
    ids = torch.arange(n)
    with torch.no_grad():
        out_list = proc(ids, hidden, head, _metadata(case, capture)[0], [c.clone() for c in caps])
        out_packed = proc(ids, hidden, head, md, packed.clone())
    want = packed[_expected_rows(case, capture, n)]
    assert out_list.hidden_states.shape == (want.shape[0], K * H)
    assert torch.equal(out_list.hidden_states, want)
    assert out_packed.hidden_states.shape == (want.shape[0], K * H), (
        f"packed aux states came back as {tuple(out_packed.hidden_states.shape)}"
    )
    assert torch.equal(out_packed.hidden_states, want)
    assert torch.equal(out_list.next_token_logits, out_packed.next_token_logits)


@GUARD
@pytest.mark.parametrize("case", CASES)
def test_pruning_keeps_the_packed_form(lp, case):
    proc, _ = lp
    md, n = _metadata(case, "last")
    packed = torch.randn(n, K * H)
    _, _, aux_pruned, _, _, _ = proc._get_pruned_states(torch.randn(n, H), None, packed, md)
    assert isinstance(aux_pruned, torch.Tensor)
    assert aux_pruned.shape[-1] == K * H


def test_no_aux_states_unchanged(lp):
    proc, head = lp
    md, n = _metadata("extend", "last")
    hidden = torch.randn(n, H)
    with torch.no_grad():
        out = proc(torch.arange(n), hidden, head, md, None)
    assert torch.equal(out.hidden_states, hidden[_expected_rows("extend", "last", n)])
