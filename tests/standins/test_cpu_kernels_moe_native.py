"""SGLang's CPU MoE with the fused kernels' skipped slots and router weight on the input
(harness.standins.cpu_kernels.moe_native) against the definition of the MoE:

* slot ``k`` of token ``t`` adds ``w[t, k] * E_{id[t, k]}(x[t])``, nothing when
  ``id[t, k] < 0``;
* with ``apply_router_weight_on_input`` it adds ``E_{id[t, k]}(w[t, k] * x[t])``;

where ``E_e(x) = W2_e (silu(W1_e x) * W3_e x)``. First with a strict stand-in for
SGLang's ``moe_forward_native`` (it refuses what SGLang's refuses: negative or repeated
ids in a row, the weight on the input), then with SGLang's own function."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from harness.standins.cpu_kernels import moe_native

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

E, H, INTER = 4, 8, 6


class TopK(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


@dataclasses.dataclass
class RunnerConfig:
    activation: str = "silu"
    apply_router_weight_on_input: bool = False


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(num_experts=E, w13_weight=torch.randn(E, 2 * INTER, H, generator=g),
                           w2_weight=torch.randn(E, H, INTER, generator=g))


def _expert(layer, e, x):
    gate, up = (layer.w13_weight[e] @ x).chunk(2)
    return layer.w2_weight[e] @ (torch.nn.functional.silu(gate) * up)


def _definition(layer, x, ids, weights, on_input=False):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, w = int(ids[t, k]), weights[t, k]
            if e < 0:
                continue
            out[t] += _expert(layer, e, w * x[t]) if on_input else w * _expert(layer, e, x[t])
    return out


class Strict:
    """What SGLang's moe_forward_native computes and refuses (for the wrapper's logic)."""

    def __init__(self):
        self.calls = []

    def __call__(self, layer, x, topk_output, config):
        self.calls.append(topk_output)
        if config.apply_router_weight_on_input:
            raise NotImplementedError()
        ids = topk_output.topk_ids
        if bool((ids < 0).any()) or bool((ids >= layer.num_experts).any()):
            raise IndexError("expert id out of range")
        for row in ids.tolist():
            if len(set(row)) != len(row):
                raise ValueError(f"repeated expert ids in a row: {row}")
        return _definition(layer, x, ids, topk_output.topk_weights)


@pytest.fixture()
def strict(monkeypatch):
    fake = Strict()
    monkeypatch.setattr(moe_native, "_original", lambda: fake)
    return fake


def _case(seed=1, tokens=5, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=g)
    return x, ids, weights


def test_plain_batches_pass_through_untouched(strict):
    layer = _layer()
    x, ids, w = _case()
    topk = TopK(w, ids, torch.zeros(5, E))
    out = moe_native.moe_forward_native(layer, x, topk, RunnerConfig())
    assert strict.calls == [topk] and strict.calls[0] is topk
    torch.testing.assert_close(out, _definition(layer, x, ids, w))


def test_skipped_slots_add_nothing(strict):
    layer = _layer()
    x, ids, w = _case(k=3)
    ids[0, 1] = -1
    ids[2, 0] = -1
    ids[3] = -1  # a token with every slot skipped
    ids_before, w_before = ids.clone(), w.clone()
    topk = TopK(w, ids, torch.zeros(5, E))
    out = moe_native.moe_forward_native(layer, x, topk, RunnerConfig())
    torch.testing.assert_close(out, _definition(layer, x, ids_before, w_before))
    assert torch.count_nonzero(out[3]) == 0
    # the caller's routing is left as it was; what ran had distinct, valid ids per row
    assert torch.equal(ids, ids_before) and torch.equal(w, w_before)
    ran = strict.calls[0]
    assert ran.topk_ids.dtype == ids.dtype
    assert torch.equal(ran.topk_weights[ids_before < 0], torch.zeros(int((ids_before < 0).sum())))


def test_repeated_experts_in_a_row(strict):
    """0.5.23's LongCat-Flash parks zero-expert slots on expert 0 with weight 0, beside a
    real expert 0; a repeated expert with a weight adds once per slot."""
    layer = _layer(4)
    x, ids, w = _case(seed=11, k=3)
    ids[0] = torch.tensor([0, 0, 2], dtype=ids.dtype)
    w[0, 1] = 0.0  # parked: adds nothing
    ids[1] = torch.tensor([1, 3, 1], dtype=ids.dtype)  # expert 1 twice, both weighted
    ids[2] = torch.tensor([0, 0, 0], dtype=ids.dtype)
    w[2, 1:] = 0.0
    ids_before, w_before = ids.clone(), w.clone()
    out = moe_native.moe_forward_native(layer, x, TopK(w, ids, torch.zeros(5, E)), RunnerConfig())
    torch.testing.assert_close(out, _definition(layer, x, ids_before, w_before))
    assert torch.equal(ids, ids_before) and torch.equal(w, w_before)


def test_router_weight_on_the_input(strict):
    layer = _layer(2)
    for k in (1, 2):
        x, ids, w = _case(seed=3 + k, k=k)
        topk = TopK(w, ids, torch.zeros(5, E))
        out = moe_native.moe_forward_native(layer, x, topk,
                                            RunnerConfig(apply_router_weight_on_input=True))
        want = _definition(layer, x, ids, w, on_input=True)
        torch.testing.assert_close(out, want)
        # not the same as weighting the output (silu is not linear)
        assert not torch.allclose(out, _definition(layer, x, ids, w), atol=1e-3)


def test_skipped_slots_with_the_weight_on_the_input(strict):
    layer = _layer(3)
    x, ids, w = _case(seed=9, k=2)
    ids[1, 0] = -1
    topk = TopK(w, ids, torch.zeros(5, E))
    out = moe_native.moe_forward_native(layer, x, topk,
                                        RunnerConfig(apply_router_weight_on_input=True))
    torch.testing.assert_close(out, _definition(layer, x, ids, w, on_input=True))


def test_install_routes_sglangs_cpu_path_and_matches_the_definition(monkeypatch):
    native = pytest.importorskip("sglang.srt.layers.moe.fused_moe_native")
    from sglang.srt.layers import activation
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    if hasattr(activation, "get_global_server_args"):  # the pin's SiluAndMul reads one field
        monkeypatch.setattr(activation, "get_global_server_args",
                            lambda: SimpleNamespace(rl_on_policy_target=None))

    sglang_own = native.moe_forward_native
    try:
        moe_native.install()
        moe_native.install()  # idempotent
        assert native.moe_forward_native is moe_native.moe_forward_native
        assert moe_native._original() is sglang_own
        layer = _layer(4)
        x, ids, w = _case(seed=11, tokens=6, k=2)
        ids[0, 0] = -1
        ids[4] = -1
        out = native.moe_forward_native(layer, x, StandardTopKOutput(w, ids, torch.zeros(6, E)),
                                        MoeRunnerConfig())
        torch.testing.assert_close(out, _definition(layer, x, ids, w))
        x1, ids1, w1 = _case(seed=12, tokens=6, k=1)
        out = native.moe_forward_native(layer, x1, StandardTopKOutput(w1, ids1, torch.zeros(6, E)),
                                        MoeRunnerConfig(apply_router_weight_on_input=True))
        torch.testing.assert_close(out, _definition(layer, x1, ids1, w1, on_input=True))
        with pytest.raises(NotImplementedError):  # SGLang's own refuses it
            sglang_own(layer, x1, StandardTopKOutput(w1, ids1, torch.zeros(6, E)),
                       MoeRunnerConfig(apply_router_weight_on_input=True))
    finally:
        moe_native.uninstall()
    assert native.moe_forward_native is sglang_own
