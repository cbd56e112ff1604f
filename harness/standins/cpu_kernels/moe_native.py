"""SGLang's CPU MoE (``moe_forward_native``) with two GPU-kernel semantics it lacks.

On a CPU without sgl-kernel's AMX build, ``UnquantizedFusedMoEMethod.forward_cpu``
(pin ``layers/quantization/unquant.py`` 608, 0.5.23 1383) runs
``layers/moe/fused_moe_native.py:moe_forward_native``. Two things the fused Triton kernels
(``moe_runner/triton_utils/fused_moe.py``: ``fused_experts_impl``) do have no CPU path
there:

* **Skipped slots.** A routed expert id of ``-1`` means "no expert": the kernels skip the
  slot (``moe_align_block_size`` drops ids outside the expert range), so it adds nothing.
  LongCat-Flash relies on it: ``zero_experts_compute_triton`` sets the ids of its zero
  experts to ``-1`` and their weights to 0 in place before the routed experts run
  (``LongcatFlashMoE.forward``, pin longcat_flash.py 262-293). ``moe_forward_native``'s
  first step, ``cnts.scatter_(1, topk_ids, 1)``, raises on ``-1``.
* **Router weight on the input.** With ``apply_router_weight_on_input`` (Llama 4's
  ``Llama4MoE``, llama4.py 123-131) the kernels multiply the first GEMM's output, the
  ``[gate | up]`` projection, by the slot's weight and leave the second GEMM unweighted
  (``fused_experts_impl``: ``mul_routed_weight`` is ``apply_router_weight_on_input`` for
  the first ``invoke_fused_moe_kernel`` and its negation for the second): slot ``k``
  contributes ``expert_k(w_k * x)``, the projections being linear. ``moe_forward_native``
  raises ``NotImplementedError`` for it.

:func:`moe_forward_native` gives both, computing every expert with SGLang's own
``moe_forward_native``:

* slots with ``id < 0`` get weight 0 and an expert id their row does not use (ids in a row
  stay distinct, as ``moe_forward_native`` counts a row's experts with a scatter); every
  expert output is finite, so such a slot adds an exact 0;
* with ``apply_router_weight_on_input``, slot ``k`` runs as a one-slot batch on
  ``w_k * x`` with weight 1 and the flag off, and the slots are summed (one call when
  ``top_k`` is 1, Llama 4's case).

* a slot whose expert already appears earlier in its row (0.5.23's
  ``zero_experts_compute_triton`` parks zero-expert slots on expert 0 with weight 0,
  next to a real expert 0) is skipped when its weight is 0; with a weight, the slots run
  one at a time and are summed, as the kernels add every slot.

Anything else goes to SGLang's function untouched, and the caller's ``topk_output`` is
never modified. :func:`install` puts it where ``forward_cpu`` imports it from (the
``from ...fused_moe_native import moe_forward_native`` runs at each call).

Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any

MODULE = "sglang.srt.layers.moe.fused_moe_native"

_SAVED: dict[str, Any] = {}


def _original():
    import importlib

    mod = importlib.import_module(MODULE)
    return _SAVED.get("moe_forward_native", mod.moe_forward_native)


def _free_experts(topk_ids, skipped, num_experts: int):
    """Per row, a distinct expert the row does not route to, for each skipped slot."""
    import torch

    used = torch.zeros((topk_ids.shape[0], num_experts + 1), dtype=torch.int64,
                       device=topk_ids.device)
    # column num_experts collects the skipped slots and is dropped
    col = torch.where(skipped, torch.full_like(topk_ids, num_experts), topk_ids).long()
    used.scatter_(1, col, 1)
    free_first = torch.argsort(used[:, :num_experts], dim=1, stable=True)  # unused ids first
    nth = (skipped.long().cumsum(dim=1) - 1).clamp(min=0)
    return free_first.gather(1, nth).to(topk_ids.dtype)


def moe_forward_native(layer, x, topk_output, moe_runner_config):
    """``fused_moe_native.moe_forward_native`` with skipped slots (``topk_ids < 0``) and
    ``apply_router_weight_on_input`` as the fused kernels compute them."""
    import dataclasses

    import torch

    original = _original()
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    rest = tuple(topk_output)[2:]
    repeated = _repeated(topk_ids)
    # A repeated id with weight 0 adds nothing (0.5.23's zero_experts_compute_triton parks
    # LongCat-Flash's zero-expert slots on expert 0 with weight 0): skipped like -1.
    skipped = (topk_ids < 0) | (repeated & (topk_weights == 0))
    if bool(skipped.any()):
        topk_ids = torch.where(skipped, _free_experts(topk_ids, skipped, layer.num_experts),
                               topk_ids)
        topk_weights = torch.where(skipped, torch.zeros_like(topk_weights), topk_weights)
    per_slot = moe_runner_config.apply_router_weight_on_input or bool((repeated & ~skipped).any())
    if not per_slot:
        if topk_ids is topk_output[1]:
            return original(layer, x, topk_output, moe_runner_config)
        return original(layer, x, type(topk_output)(topk_weights, topk_ids, *rest),
                        moe_runner_config)
    # One slot at a time, summed: the weight on the input (slot k adds E(w_k * x)), or an
    # expert repeated in a row with a weight (each slot adds w_k * E(x), as the kernels do).
    on_input = moe_runner_config.apply_router_weight_on_input
    config = dataclasses.replace(moe_runner_config, apply_router_weight_on_input=False)
    out = None
    for k in range(topk_ids.shape[1]):
        w = topk_weights[:, k:k + 1]
        ids = topk_ids[:, k:k + 1].contiguous()
        if on_input:
            slot = type(topk_output)(torch.ones_like(w), ids, *rest)
            part = original(layer, (x * w.to(x.dtype)).to(x.dtype), slot, config)
        else:
            part = original(layer, x, type(topk_output)(w.contiguous(), ids, *rest), config)
        out = part if out is None else out + part
    return out


def _repeated(topk_ids):
    """Slots whose expert id already appears earlier in the same row."""
    import torch

    rep = torch.zeros_like(topk_ids, dtype=torch.bool)
    for k in range(1, topk_ids.shape[1]):
        rep[:, k] = (topk_ids[:, :k] == topk_ids[:, k:k + 1]).any(dim=1) & (topk_ids[:, k] >= 0)
    return rep


def install() -> None:
    """Route ``fused_moe_native.moe_forward_native`` through :func:`moe_forward_native`
    (a family ``setup`` hook; idempotent)."""
    import importlib

    mod = importlib.import_module(MODULE)
    if mod.moe_forward_native is not moe_forward_native:
        _SAVED.setdefault("moe_forward_native", mod.moe_forward_native)
        mod.moe_forward_native = moe_forward_native


def uninstall() -> None:
    import importlib

    mod = importlib.import_module(MODULE)
    if "moe_forward_native" in _SAVED:
        mod.moe_forward_native = _SAVED.pop("moe_forward_native")
