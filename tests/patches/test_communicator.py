"""LayerCommunicator's capture decision (patch comm-readonly-residual), at TP = 1.

The decision ``_post_attn_residual_is_read_only`` is driven over all its inputs on
a real LayerCommunicator taken from the real decoder layer: which communicate
function prepare_mlp will use, input-scattered attention TP, the attention TP size,
FlashInfer fusion on/off (SGLang's own predicate, hardware check answered yes),
the aiter fusion, the token count, the residual's contiguity and whether the norm
has the fused entry point.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import unittest.mock as mock

import pytest
import torch

from harness.standins.batch import make_forward_batch
from harness.standins.kernels import fusion_mode

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

GUARD = pytest.mark.guards("comm-readonly-residual")


@pytest.fixture
def comm(tiny_model):
    return tiny_model.layers[3].layer_communicator


def _fn(name):
    from sglang.srt.layers.communicator import (
        CommunicateWithAllReduceAndLayerNormFn as F,
    )
    from sglang.srt.layers.communicator import ScatterMode

    raw = getattr(F, name)
    if name.startswith("_gather") or name.startswith("_scatter"):
        return functools.partial(raw, residual_input_mode=ScatterMode.TP_ATTN_FULL)
    return raw


@contextlib.contextmanager
def _state(comm, *, fn, scattered, attn_tp, fusion, aiter, fused_norm):
    from sglang.srt.layers import communicator

    ctx = communicator.get_attn_tp_context()
    patches = [
        mock.patch.object(comm, "_communicate_with_all_reduce_and_layer_norm_fn", _fn(fn)),
        mock.patch.object(ctx, "input_scattered_", scattered),
        mock.patch.object(comm._context, "attn_tp_size", attn_tp),
    ]
    if aiter:
        patches.append(
            mock.patch.object(communicator, "apply_aiter_all_reduce_fusion", lambda t: True)
        )
    if not fused_norm:
        patches.append(mock.patch.object(comm, "post_attention_layernorm", torch.nn.Identity()))
    with fusion_mode("flashinfer" if fusion else "off"), contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


FNS = [
    "_simple",
    "_gather_hidden_states_and_residual",
    "_gather_hidden_states_and_residual_moe",
    "_scatter_hidden_states_and_residual",
    "_tp_attn_all_reduce_and_layernorm",
]


def _expected(fn, scattered, attn_tp, fusion, aiter, fused_norm, tokens, contiguous):
    return (
        fn.startswith("_gather")
        and not scattered
        and attn_tp > 1
        and fusion
        and not aiter
        and fused_norm
        and 0 < tokens <= 2048
        and contiguous
    )


@GUARD
def test_read_only_decision_over_all_inputs(comm):
    checked = 0
    for fn, scattered, attn_tp, fusion, aiter, fused_norm in itertools.product(
        FNS, [False, True], [1, 2], [False, True], [False, True], [True, False]
    ):
        with _state(comm, fn=fn, scattered=scattered, attn_tp=attn_tp, fusion=fusion,
                    aiter=aiter, fused_norm=fused_norm):
            for tokens, contiguous in itertools.product([0, 1, 2048, 2049], [True, False]):
                residual = torch.zeros(tokens, 32, dtype=torch.float64)[:, ::2]
                if contiguous:
                    residual = residual.contiguous()
                got = comm._post_attn_residual_is_read_only(residual)
                want = _expected(fn, scattered, attn_tp, fusion, aiter, fused_norm, tokens,
                                 contiguous)
                assert got == want, (
                    f"{fn} scattered={scattered} attn_tp={attn_tp} fusion={fusion} "
                    f"aiter={aiter} fused_norm={fused_norm} tokens={tokens} "
                    f"contiguous={contiguous}: got {got}, want {want}"
                )
                checked += 1
    assert checked == len(FNS) * 2 * 2 * 2 * 2 * 2 * 4 * 2


@pytest.mark.parametrize("read_only", [pytest.param(True, marks=GUARD), False])
def test_capture_aliases_residual_only_when_read_only(comm, read_only):
    """Read-only: the capture is the residual itself (no clone). Otherwise a private
    copy that a later in-place norm cannot change."""
    fb = make_forward_batch(torch.arange(4))
    hidden = torch.randn(4, 16, dtype=torch.float64)
    residual = torch.randn(4, 16, dtype=torch.float64)
    captured = []
    with _state(comm, fn="_gather_hidden_states_and_residual", scattered=False,
                attn_tp=2 if read_only else 1, fusion=True, aiter=False, fused_norm=True):
        _, res = comm.prepare_attn_and_capture_last_layer_outputs(
            hidden, residual, fb, captured_last_layer_outputs=captured
        )
    assert len(captured) == 1
    if read_only:
        assert captured[0] is res
    else:
        assert captured[0] is not res
        assert captured[0].untyped_storage().data_ptr() != res.untyped_storage().data_ptr()
        expected = res.clone()
        res.add_(1)  # prepare_mlp's in-place fused add + RMSNorm
        assert torch.equal(captured[0], expected)


@GUARD
def test_quant_format_reaches_prepare_attn(comm):
    fb = make_forward_batch(torch.arange(3))
    hidden = torch.randn(3, 16, dtype=torch.float64)
    with mock.patch.object(comm, "prepare_attn", wraps=comm.prepare_attn) as spy:
        comm.prepare_attn_and_capture_last_layer_outputs(
            hidden, None, fb, captured_last_layer_outputs=[], quant_format="fp8_test"
        )
    assert spy.call_args.kwargs.get("quant_format") == "fp8_test"


def test_capture_without_collector_matches_prepare_attn(comm):
    """No collector: the method is prepare_attn, nothing captured, same outputs."""
    fb = make_forward_batch(torch.arange(3))
    h = torch.randn(3, 16, dtype=torch.float64)
    r = torch.randn(3, 16, dtype=torch.float64)
    h1, r1 = comm.prepare_attn(h.clone(), r.clone(), fb)
    h2, r2 = comm.prepare_attn_and_capture_last_layer_outputs(h.clone(), r.clone(), fb)
    assert torch.equal(h1, h2) and torch.equal(r1, r2)
