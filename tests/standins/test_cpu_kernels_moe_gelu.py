"""The gated-GELU fused MoE stand-in (harness.standins.cpu_kernels.moe_gelu) against its
definition (per token, the weighted sum over its routed experts of
``W2 @ (gelu_tanh(gate) * up)``), against SGLang's own torch fallback
(``moe_forward_native``), its aliasing (a fresh output, no input written), and its
installation (only where SGLang's CPU path refuses ``gelu``, only for ``gelu``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.standins.cpu_kernels import moe_gelu

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

E, H, INTER, T, K = 4, 8, 6, 5, 2


def _case(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = torch.randn(E, 2 * INTER, H, generator=g).to(dtype)
    w2 = torch.randn(E, H, INTER, generator=g).to(dtype)
    weights = torch.rand(T, K, generator=g)
    # Token 0 routes to experts 0 and 1, token 1 to 1 and 0 (order), expert 3 gets none.
    ids = torch.tensor([[0, 1], [1, 0], [2, 0], [1, 2], [2, 1]], dtype=torch.int32)
    return x, w13, w2, weights, ids


def _gelu_tanh(v: float) -> float:
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def _naive(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e].double() @ x[t].double()
            act = torch.tensor([_gelu_tanh(float(gate_up[i])) * float(gate_up[INTER + i])
                                for i in range(INTER)], dtype=torch.float64)
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


def test_matches_the_definition():
    x, w13, w2, weights, ids = _case()
    got = moe_gelu.fused_experts_gelu(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _naive(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-4)


def test_matches_sglang_torch_fallback():
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    x, w13, w2, weights, ids = _case(seed=1)
    layer = SimpleNamespace(num_experts=E, w13_weight=w13, w2_weight=w2)
    config = SimpleNamespace(activation="gelu", apply_router_weight_on_input=False,
                             gemm1_alpha=None, gemm1_clamp_limit=None)
    want = moe_forward_native(layer, x, (weights, ids, None), config)
    torch.testing.assert_close(moe_gelu.fused_experts_gelu(x, w13, w2, weights, ids), want,
                               rtol=1e-5, atol=1e-5)


def test_fresh_output_and_inputs_untouched():
    x, w13, w2, weights, ids = _case(seed=2)
    before = [t.clone() for t in (x, w13, w2, weights, ids)]
    out = moe_gelu.fused_experts_gelu(x, w13, w2, weights, ids)
    for t in (x, w13, w2, weights, ids):
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    for t, b in zip((x, w13, w2, weights, ids), before):
        assert torch.equal(t, b)


@pytest.fixture
def restore():
    yield
    moe_gelu.uninstall()


def _call(method, activation, x, w13, w2, weights, ids):
    config = SimpleNamespace(activation=activation, apply_router_weight_on_input=False,
                             gemm1_alpha=None, gemm1_clamp_limit=None)
    layer = SimpleNamespace(num_experts=E, w13_weight=w13, w2_weight=w2,
                            use_intel_amx_backend=False, moe_runner_config=config)
    dispatch = SimpleNamespace(hidden_states=x, topk_output=(weights, ids, None))
    return method(SimpleNamespace(moe_runner_config=config), layer, dispatch).hidden_states


def test_installs_only_where_this_base_refuses_gelu(restore):
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as cls

    original = cls.forward_cpu
    refused = moe_gelu.refuses_gelu()
    assert moe_gelu.install() is refused
    assert moe_gelu.install() is refused  # idempotent
    if not refused:  # this base runs gelu itself (0.5.23): nothing replaced
        assert cls.forward_cpu is original and not moe_gelu.installed()
        return
    x, w13, w2, weights, ids = _case(seed=3)
    assert cls.forward_native is cls.forward_cpu is not original
    torch.testing.assert_close(_call(cls.forward_cpu, "gelu", x, w13, w2, weights, ids),
                               moe_gelu.fused_experts_gelu(x, w13, w2, weights, ids))
    moe_gelu.uninstall()
    assert cls.forward_cpu is original and not moe_gelu.installed()


def test_wraps_a_refusing_path_for_gelu_only(monkeypatch):
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as cls

    calls = []

    def sglang_cpu(self, layer, dispatch_output):  # a CPU path that, like the pin's, is silu-only
        assert self.moe_runner_config.activation == "silu"
        calls.append(layer)
        return SimpleNamespace(hidden_states="sglang's own")

    monkeypatch.setattr(cls, "forward_cpu", sglang_cpu)
    monkeypatch.setattr(cls, "forward_native", sglang_cpu)
    try:
        assert moe_gelu.install() is True
        x, w13, w2, weights, ids = _case(seed=4)
        torch.testing.assert_close(_call(cls.forward_native, "gelu", x, w13, w2, weights, ids),
                                   moe_gelu.fused_experts_gelu(x, w13, w2, weights, ids))
        assert not calls
        assert _call(cls.forward_cpu, "silu", x, w13, w2, weights, ids) == "sglang's own"
        assert len(calls) == 1
    finally:
        moe_gelu.uninstall()
    assert cls.forward_cpu is sglang_cpu and cls.forward_native is sglang_cpu
