"""SGLang 0.5.23's all-reduce fusion, switched per block of code (``fusion_mode``).

0.5.23 decides fusion on the consumer side (``layers/layer_boundary``): the next
stage's entry tries the candidates bound at construction (``fused_attn_input``,
``fused_ffn_input`` in ``layer_boundary/fusions/allreduce.py``), each gated per call
by ``flashinfer_ar_fusion_applies(batch_size)`` / ``aiter_ar_fusion_applies(tensor,
forward_batch)`` (``residual/add_norm.py``). Both predicates are imported *by name*
(``fusions/allreduce.py``, ``exit.py``), so they are replaced in every loaded
``sglang`` module that holds them. The fused kernels are looked up at call time by
``layernorm._forward_with_allreduce_fusion``:
``sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`` and
``sglang.srt.distributed.tensor_model_parallel_fused_allreduce_rmsnorm``.

* ``off``: both predicates answer no (SGLang's unfused boundary all-reduces).
* ``flashinfer``: the predicate is the real one with the hardware / workspace checks
  answered yes (``0 < n <= FUSE_ALLREDUCE_MAX_BATCH_SIZE`` and no attention DP); the
  kernel is a CPU reference that all-reduces over the group the real kernel's
  workspace is built on (``resolve_fusion_group``), and returns a *fresh*
  ``(norm_out, residual_out)``, inputs untouched (the kernel's aliasing, on which
  ``flashinfer_preserves_residual`` lets the capture skip its clone).
* ``flashinfer_declined``: the same predicate, and the real FlashInfer wrapper with its
  first check answered no (FlashInfer unavailable, as on a CPU): it returns ``(None,
  None)`` and ``_forward_with_allreduce_fusion``'s own fallback runs (all-reduce over
  the kernel's group, then the norm into a residual of its own).
* ``aiter``: ``layernorm._use_aiter`` (the kernel choice) and ``allreduce._use_aiter``
  are on, ``exec.comm.enable_aiter_allreduce_fusion`` is overridden on, the predicate
  is the real one without its ROCm gate; the kernel is an in-place CPU reference
  (``residual += all_reduce(x); x = rmsnorm(residual)``) over the TP group, as
  ``GroupCoordinator.fused_allreduce_rmsnorm``.

On a CUDA machine the FlashInfer kernel and predicate stay SGLang's own (``flashinfer``
overrides ``exec.comm.flashinfer_allreduce_fusion_backend`` to ``auto``); the aiter
reference is used everywhere, as on the pin. Each FlashInfer wrapper call's outcome is
counted in ``harness.standins.kernels.PATHS``. Stdlib-only at import time.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from harness.standins.kernels import (
    FUSION_MODES,
    allreduce_add_rmsnorm_fresh,
    allreduce_add_rmsnorm_inplace,
    has_real_kernels,
    op_body,
    recording_flashinfer,
)

__all__ = [
    "FUSION_MODES",
    "fusion_mode",
    "cpu_flashinfer_allreduce_residual_rmsnorm",
    "cpu_aiter_fused_allreduce_rmsnorm",
]


def cpu_flashinfer_allreduce_residual_rmsnorm(
    input_tensor,
    residual,
    weight,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot=None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = True,
    use_attn_tp_group: bool = True,
):
    """CPU reference of FlashInfer's kARResidualRMSNorm: fresh outputs, inputs untouched.
    ``(None, None)`` where the real wrapper declines (group of one, non-contiguous)."""
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    world_size, _rank, group = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    if world_size <= 1:
        return None, None
    if not (input_tensor.is_contiguous() and residual.is_contiguous()):
        return None, None
    assert input_tensor.shape[0] <= max_token_num
    return allreduce_add_rmsnorm_fresh(group, input_tensor, residual, weight, eps)


def cpu_aiter_fused_allreduce_rmsnorm(x, residual, weight, eps):
    """CPU reference of aiter's fused all-reduce + add + RMSNorm, in place (its
    aliasing), over the TP group (``communication_op.tensor_model_parallel_fused_
    allreduce_rmsnorm`` -> ``get_tp_group().fused_allreduce_rmsnorm``)."""
    from sglang.srt.runtime_context import get_parallel

    return allreduce_add_rmsnorm_inplace(get_parallel().tp_group, x, residual, weight, eps)


def _holders(name: str, original) -> list:
    """Every loaded sglang module that bound ``original`` under ``name``."""
    return [
        mod
        for mod_name, mod in list(sys.modules.items())
        if mod is not None
        and (mod_name == "sglang" or mod_name.startswith("sglang."))
        and getattr(mod, name, None) is original
    ]


@contextlib.contextmanager
def fusion_mode(mode: str) -> Iterator[None]:
    """Switch SGLang 0.5.23's all-reduce fusion decision and kernels for the duration."""
    if mode not in FUSION_MODES:
        raise ValueError(f"fusion mode {mode!r} not in {FUSION_MODES}")
    import sglang.srt.distributed as dist_pkg
    from sglang.srt.layers import flashinfer_comm_fusion, layernorm
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.layer_boundary.fusions import allreduce
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.runtime_context import get_exec, get_parallel

    real = has_real_kernels()
    max_bs = add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE

    def never(*_args, **_kwargs):
        return False

    def flashinfer_applies(batch_size: int):
        # add_norm.flashinfer_ar_fusion_applies with the sm90/sm100, flashinfer,
        # backend and workspace checks answered yes.
        return not is_dp_attention_enabled() and 0 < batch_size <= max_bs

    def aiter_applies(input_tensor, forward_batch):
        # add_norm.aiter_ar_fusion_applies without its ROCm gate (_use_aiter).
        n = input_tensor.shape[-1]
        total_bytes = input_tensor.numel() * input_tensor.element_size()
        return (
            total_bytes > 0
            and n <= 16384
            and total_bytes <= 8 * 1024 * 8192
            and get_parallel().tp_size != 6
            and not is_dp_attention_enabled()
            and add_norm.aiter_ar_fusion_enabled_for(forward_batch.forward_mode)
        )

    fi_pred = {"off": never, "flashinfer": flashinfer_applies,
               "flashinfer_declined": flashinfer_applies, "aiter": never}[mode]
    aiter_pred = aiter_applies if mode == "aiter" else never
    if real and mode == "flashinfer":
        fi_pred = None  # SGLang's own predicate and kernel

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    with contextlib.ExitStack() as stack:
        try:
            if fi_pred is not None:
                original = add_norm.flashinfer_ar_fusion_applies
                for mod in _holders("flashinfer_ar_fusion_applies", original):
                    patch(mod, "flashinfer_ar_fusion_applies", fi_pred)
            for mod in _holders("aiter_ar_fusion_applies", add_norm.aiter_ar_fusion_applies):
                patch(mod, "aiter_ar_fusion_applies", aiter_pred)
            if mode == "flashinfer":
                if real:
                    stack.enter_context(
                        get_exec().comm.override(flashinfer_allreduce_fusion_backend="auto")
                    )
                    kernel = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm
                else:
                    kernel = cpu_flashinfer_allreduce_residual_rmsnorm
                patch(flashinfer_comm_fusion, "flashinfer_allreduce_residual_rmsnorm",
                      recording_flashinfer(kernel))
            elif mode == "flashinfer_declined":
                patch(flashinfer_comm_fusion, "is_flashinfer_available", lambda: False)
                patch(flashinfer_comm_fusion, "flashinfer_allreduce_residual_rmsnorm",
                      recording_flashinfer(op_body(
                          flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm,
                          flashinfer_comm_fusion, "flashinfer_allreduce_residual_rmsnorm")))
            elif mode == "aiter":
                stack.enter_context(get_exec().comm.override(enable_aiter_allreduce_fusion=True))
                patch(layernorm, "_use_aiter", True)
                patch(allreduce, "_use_aiter", True)
                patch(dist_pkg, "tensor_model_parallel_fused_allreduce_rmsnorm",
                      cpu_aiter_fused_allreduce_rmsnorm)
            yield
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
