"""CPU stand-ins for SGLang's GPU-only kernels, with the GPU kernels' aliasing.

Only these are replaced, and only on a machine without the real kernels:

* the CUDA ``fused_add_rmsnorm`` (RMSNorm with a residual), by a CPU version with
  the same aliasing: ``residual`` and ``x`` are updated in place and returned;
* FlashInfer's fused all-reduce + residual + RMSNorm, by a CPU reference that
  all-reduces over the real TP group and returns a *fresh* ``residual_out`` and
  ``norm_out`` (the kernel's aliasing);
* the aiter fused all-reduce + RMSNorm, by a CPU reference that updates its inputs
  in place (its aliasing), for the "aiter-like" fusion mode.

:func:`fusion_mode` switches SGLang's own fusion decision and kernels for a block of
code. Stdlib-only at import time; torch and sglang are imported inside functions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

FUSION_MODES = ("off", "flashinfer", "aiter")


def _torch():
    import torch

    return torch


def has_real_kernels() -> bool:
    """True on a CUDA machine: stand-ins switch off and the real kernels run."""
    return device().startswith("cuda")


def device() -> str:
    """``$HARNESS_DEVICE``, else ``cuda`` (the rank's current device) when available."""
    import os

    torch = _torch()
    want = os.environ.get("HARNESS_DEVICE")
    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return want


def model_dtype(cfg):
    """float64 on CPU; CUDA kernels (RMSNorm, FlashInfer) take float32, still exact for
    the small integers these tests produce."""
    torch = _torch()
    dtype = getattr(torch, cfg.dtype)
    if has_real_kernels() and dtype == torch.float64:
        return torch.float32
    return dtype


# --------------------------------------------------------------------------
# kernel stand-ins
# --------------------------------------------------------------------------


def _rms(x, weight, eps):
    torch = _torch()
    orig = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(orig) * weight.to(orig)


def cpu_rmsnorm_forward(norm, x, residual=None, post_residual_addition=None, *, gemma=False):
    """RMSNorm with the CUDA kernels' aliasing (``fused_add_rmsnorm`` is in place).

    ``gemma``: GemmaRMSNorm's ``x * (1 + w)`` (``gemma_fused_add_rmsnorm``, also in place).
    """
    weight = norm.weight.data
    if gemma:
        weight = 1.0 + weight
    if x.shape[0] == 0:
        return x if residual is None else (x, residual)
    if residual is None:
        return _rms(x, weight, norm.variance_epsilon)
    if post_residual_addition is not None:
        residual = residual + post_residual_addition
    # fused_add_rmsnorm(x, residual, w, eps): residual += x; x = rmsnorm(residual) * w
    residual.add_(x)
    x.copy_(_rms(residual, weight, norm.variance_epsilon))
    return x, residual


def install_cpu_norm(module) -> int:
    """Route every SGLang RMSNorm / GemmaRMSNorm under ``module`` to the in-place CPU kernel."""
    import functools

    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    n = 0
    for sub in module.modules():
        if isinstance(sub, (RMSNorm, GemmaRMSNorm)):
            sub._forward_method = functools.partial(
                cpu_rmsnorm_forward, sub, gemma=isinstance(sub, GemmaRMSNorm)
            )
            n += 1
    return n


def _reduce_group(use_attn_tp_group: bool):
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.layers.dp_attention import get_attention_tp_group

    return get_attention_tp_group() if use_attn_tp_group else get_tp_group()


def cpu_flashinfer_allreduce_residual_rmsnorm(
    input_tensor,
    residual,
    weight,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot=None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = False,
    use_attn_tp_group: bool = True,
):
    """CPU reference of FlashInfer's kARResidualRMSNorm: fresh outputs, inputs untouched."""
    group = _reduce_group(use_attn_tp_group)
    if group.world_size <= 1:
        return None, None
    if not (input_tensor.is_contiguous() and residual.is_contiguous()):
        return None, None
    assert input_tensor.shape[0] <= max_token_num
    return allreduce_add_rmsnorm_fresh(group, input_tensor, residual, weight, eps)


def cpu_aiter_fused_allreduce_rmsnorm(x, residual, weight, eps):
    """CPU reference of an in-place fused all-reduce + add + RMSNorm (aiter-like)."""
    return allreduce_add_rmsnorm_inplace(_reduce_group(True), x, residual, weight, eps)


def allreduce_add_rmsnorm_fresh(group, x, residual, weight, eps):
    """FlashInfer's aliasing: ``norm(all_reduce(x) + residual)`` and the sum, both in
    fresh storage; ``x`` and ``residual`` untouched. Every base's FlashInfer stand-in."""
    torch = _torch()
    reduced = group.all_reduce(x.clone())
    residual_out = torch.empty_like(residual)
    torch.add(reduced, residual, out=residual_out)
    norm_out = torch.empty_like(x)
    norm_out.copy_(_rms(residual_out, weight, eps))
    return norm_out, residual_out


def allreduce_add_rmsnorm_inplace(group, x, residual, weight, eps):
    """aiter's aliasing: the sum into ``residual`` and the norm into ``x``, in place."""
    reduced = group.all_reduce(x.clone())
    residual.add_(reduced)
    x.copy_(_rms(residual, weight, eps))
    return x, residual


@contextlib.contextmanager
def fusion_mode(mode: str) -> Iterator[None]:
    """Switch SGLang's all-reduce fusion decision and kernels for the duration.

    ``off``: the pin's CPU behaviour (no fusion). ``flashinfer``: SGLang's own
    FlashInfer decision logic runs with the hardware check answered yes, and the
    kernel is the CPU reference (fresh ``residual_out``). ``aiter``: SGLang's aiter
    fusion branch, with an in-place CPU reference kernel.
    """
    if mode not in FUSION_MODES:
        raise ValueError(f"fusion mode {mode!r} not in {FUSION_MODES}")
    from harness.standins import bases

    other = bases.module("kernels")
    if other is not None:  # another base decides and fuses elsewhere
        with other.fusion_mode(mode):
            yield
        return
    from sglang.srt.layers import communicator, flashinfer_comm_fusion, layernorm
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.server_args import get_global_server_args

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    sa = get_global_server_args()
    patch(sa, "enable_flashinfer_allreduce_fusion", mode == "flashinfer")
    patch(sa, "enable_aiter_allreduce_fusion", mode == "aiter")
    if mode == "flashinfer" and not has_real_kernels():
        max_bs = communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE

        def apply_flashinfer_allreduce_fusion(batch_size: int):
            # The pin's predicate with the sm90/sm100 + flashinfer check answered yes.
            return (
                batch_size > 0
                and batch_size <= max_bs
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_flashinfer_allreduce_fusion
            )

        patch(communicator, "apply_flashinfer_allreduce_fusion", apply_flashinfer_allreduce_fusion)
        patch(
            flashinfer_comm_fusion,
            "flashinfer_allreduce_residual_rmsnorm",
            cpu_flashinfer_allreduce_residual_rmsnorm,
        )
    elif mode == "aiter":
        patch(communicator, "_use_aiter", True)
        patch(layernorm, "_use_aiter", True)

        def apply_aiter_all_reduce_fusion(input_tensor):
            return (
                input_tensor.numel() > 0
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_aiter_allreduce_fusion
            )

        patch(communicator, "apply_aiter_all_reduce_fusion", apply_aiter_all_reduce_fusion)
        import sglang.srt.distributed as dist_pkg

        patch(
            dist_pkg,
            "tensor_model_parallel_fused_allreduce_rmsnorm",
            cpu_aiter_fused_allreduce_rmsnorm,
        )
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
