"""Unquantized fused MoE with a gated GELU on the CPU, where SGLang's CPU path refuses it.

Gemma 4's MoE (gemma4_causal.py ``Gemma4MoE``: ``FusedMoE(..., activation="gelu")``)
runs on CUDA through the Triton fused-experts kernel. On the CPU,
``UnquantizedFusedMoEMethod.forward_cpu`` of the pin asserts ``activation == "silu"``
(quantization/unquant.py) before it reaches SGLang's own torch fallback
(``fused_moe_native.moe_forward_native``, which implements ``gelu`` with
``GeluAndMul()``), so a Gemma 4 MoE model cannot run a forward there. 0.5.23 dropped
the assertion: its non-AMX CPU path is that fallback.

:func:`fused_experts_gelu` is the same op in pure torch: for each token ``t`` and each
of its ``k`` routed experts ``e = topk_ids[t, k]``,
``out[t] = sum_k topk_weights[t, k] * W2[e] @ (gelu_tanh(g) * u)`` with
``(g, u) = split(W13[e] @ x[t])`` (gate first, as SGLang stacks ``w13``), GELU's tanh
approximation (``GeluAndMul()``'s default, Gemma's ``gelu_pytorch_tanh``). The output
is a fresh tensor; no input is written (the fallback's aliasing).

:func:`install` (a parity family's ``setup`` hook) replaces the method's CPU entry points
only where the installed SGLang refuses ``gelu`` (probed, so 0.5.23 keeps its own path),
and only for ``gelu`` on the non-AMX path; everything else goes to SGLang's method.
Stdlib-only at import time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

__all__ = ["fused_experts_gelu", "refuses_gelu", "install", "uninstall", "installed"]

# The method's CPU entry points (forward_native is an alias of forward_cpu; the
# platform dispatch binds one of them when the layer is built).
_ENTRY_POINTS = ("forward_cpu", "forward_native")
_ORIGINAL: Optional[dict] = None


def fused_experts_gelu(x, w13, w2, topk_weights, topk_ids):
    """``[T, H]`` tokens through their top-k experts (``w13``: ``[E, 2I, H]``, gate rows
    first; ``w2``: ``[E, H, I]``), weighted by ``topk_weights`` ``[T, K]`` and summed."""
    import torch

    tokens, k = topk_ids.shape
    inter = w13.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    rows = x.repeat_interleave(k, dim=0)  # token t's copy for each of its k experts
    gate_up = torch.bmm(w13[ids], rows.unsqueeze(-1)).squeeze(-1)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    act = torch.nn.functional.gelu(gate, approximate="tanh") * up
    expert_out = torch.bmm(w2[ids], act.unsqueeze(-1)).squeeze(-1).view(tokens, k, -1)
    weights = topk_weights.to(expert_out.dtype).unsqueeze(-1)
    return (expert_out * weights).sum(dim=1).to(x.dtype)


def _method_class():
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    return UnquantizedFusedMoEMethod


def refuses_gelu(forward_cpu=None) -> bool:
    """Whether SGLang's unquantized MoE CPU path (``forward_cpu``, default the installed
    one) refuses ``activation="gelu"`` on a two-expert toy layer."""
    import torch

    if forward_cpu is None:
        forward_cpu = (_ORIGINAL or {}).get("forward_cpu") or _method_class().forward_cpu
    config = SimpleNamespace(activation="gelu", apply_router_weight_on_input=False,
                             gemm1_alpha=None, gemm1_clamp_limit=None)
    layer = SimpleNamespace(num_experts=2, w13_weight=torch.zeros(2, 4, 2),
                            w2_weight=torch.zeros(2, 2, 2), use_intel_amx_backend=False,
                            moe_runner_config=config)
    dispatch = SimpleNamespace(hidden_states=torch.zeros(1, 2),
                               topk_output=(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                                            None))
    try:
        forward_cpu(SimpleNamespace(moe_runner_config=config), layer, dispatch)
    except AssertionError:
        return True
    return False


def _make_forward(original):
    def forward_cpu(self, layer, dispatch_output) -> Any:
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        config = self.moe_runner_config
        if (config.activation != "gelu" or getattr(layer, "use_intel_amx_backend", False)
                or config.apply_router_weight_on_input):
            return original(self, layer, dispatch_output)
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        out = fused_experts_gelu(dispatch_output.hidden_states, layer.w13_weight,
                                 layer.w2_weight, topk_weights, topk_ids)
        return StandardCombineInput(hidden_states=out)

    forward_cpu.__qualname__ = "UnquantizedFusedMoEMethod.forward_cpu[auxcap gelu]"
    return forward_cpu


def installed() -> bool:
    return _ORIGINAL is not None


def install() -> bool:
    """Route ``gelu`` MoE on the CPU to :func:`fused_experts_gelu` where SGLang refuses
    it; idempotent. Returns whether the stand-in is (now) installed."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    cls = _method_class()
    if not refuses_gelu(cls.forward_cpu):
        return False
    _ORIGINAL = {name: cls.__dict__[name] for name in _ENTRY_POINTS if name in cls.__dict__}
    replacement = _make_forward(_ORIGINAL["forward_cpu"])
    for name in _ORIGINAL:
        setattr(cls, name, replacement)
    return True


def uninstall() -> None:
    """Put SGLang's own entry points back (layers built meanwhile keep what they bound)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        return
    cls = _method_class()
    for name, fn in _ORIGINAL.items():
        setattr(cls, name, fn)
    _ORIGINAL = None
