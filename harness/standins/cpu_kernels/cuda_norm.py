"""SGLang's CUDA RMSNorm path on the CPU: its own ``forward_cuda``, over CPU versions of
the sgl-kernel norm ops it calls, with their aliasing.

On CUDA, SGLang's norms dispatch to ``forward_cuda`` (``layers/layernorm.py``), which
calls sgl-kernel's ``rmsnorm`` / ``gemma_rmsnorm`` (fresh output) or, given a residual,
``fused_add_rmsnorm`` / ``gemma_fused_add_rmsnorm``, which write *both* inputs in place
(``residual += x``, then ``x = norm(residual)``) and return nothing. ``forward_native``
(what SGLang's CPU path runs without sgl-kernel's AMX build) adds into fresh tensors, so a
capture that aliases the residual and is read after the next norm holds the right value
on the CPU and a wrong one on CUDA: what the clone decisions of the capture path
(``_post_attn_residual_is_read_only``'s ``attn_tp_size <= 1`` at the pin, 0.5.23's
``flashinfer_preserves_residual``) are about.

:func:`install` binds the four ops (:func:`rmsnorm`, :func:`fused_add_rmsnorm`,
:func:`gemma_rmsnorm`, :func:`gemma_fused_add_rmsnorm`; sgl-kernel's signatures, float32
math, the result cast to the input's dtype) into ``sglang.srt.layers.layernorm``, where
``forward_cuda`` looks them up at call time (SGLang imports them there only on CUDA), and
routes every ``RMSNorm``, ``GemmaRMSNorm`` and ``Gemma3RMSNorm`` under a model to its
``forward_cuda``. SGLang's own dispatch then decides, per call, what CUDA decides: the
fused in-place kernels for a residual, ``forward_native`` where ``forward_cuda`` falls
back to it (a variance-size override, batch-invariant mode, ``cast_x_before_out_mul``
with a residual in float32, the pin's ``Gemma3RMSNorm``, which has no residual form),
and 0.5.23's ``Gemma3RMSNorm(h, residual)``, in place through
``gemma_fused_add_rmsnorm``. Calls are counted in :data:`harness.standins.kernels.PATHS`
(each op by its name, each ``forward_cuda`` call as ``norm_forward_cuda``).
Nothing here runs on a GPU (:func:`install` leaves the real kernels alone there).
Stdlib-only at import time.
"""

from __future__ import annotations

__all__ = ["rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
           "install", "NORM_CLASSES"]

# The norm classes whose forward_cuda runs (SGLang's layernorm.py). Subclasses are left
# alone: a model's own norm class may have a CUDA path of its own.
NORM_CLASSES = ("RMSNorm", "GemmaRMSNorm", "Gemma3RMSNorm")


def _normed(x, weight, eps: float, gemma: bool):
    """sgl-kernel's norm: float32 math, ``w`` or ``1 + w``, cast to ``x``'s dtype."""
    import torch

    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = weight.float()
    return (out * (1.0 + w if gemma else w)).to(x.dtype)


def _record(name: str) -> None:
    from harness.standins.kernels import record

    record(name)


def rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """``sgl_kernel.rmsnorm``: ``norm(input) * weight`` into ``out`` (fresh if None)."""
    import torch

    _record("rmsnorm")
    if out is None:
        out = torch.empty_like(input)
    out.copy_(_normed(input, weight, eps, gemma=False))
    return out


def gemma_rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """``sgl_kernel.gemma_rmsnorm``: ``norm(input) * (1 + weight)``."""
    import torch

    _record("gemma_rmsnorm")
    if out is None:
        out = torch.empty_like(input)
    out.copy_(_normed(input, weight, eps, gemma=True))
    return out


def _fused_add(input, residual, weight, eps: float, gemma: bool) -> None:
    residual.add_(input)
    input.copy_(_normed(residual, weight, eps, gemma))


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None) -> None:
    """``sgl_kernel.fused_add_rmsnorm``, in place: ``residual += input``, then
    ``input = norm(residual) * weight``. Returns None, as the kernel does."""
    _record("fused_add_rmsnorm")
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6,
                            enable_pdl=None) -> None:
    """``sgl_kernel.gemma_fused_add_rmsnorm``, in place, with ``1 + weight``."""
    _record("gemma_fused_add_rmsnorm")
    _fused_add(input, residual, weight, eps, gemma=True)


# What layernorm.py binds on CUDA and forward_cuda reads: the kernels, and the JIT
# HF-semantics kernel's availability flag (the JIT kernels take float16/bfloat16 only;
# forward_cuda checks the dtype before it calls them).
_BINDINGS = {
    "rmsnorm": rmsnorm,
    "fused_add_rmsnorm": fused_add_rmsnorm,
    "gemma_rmsnorm": gemma_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
    "_jit_rmsnorm_hf_available": False,
}


def install(model) -> int:
    """Route every SGLang ``RMSNorm`` / ``GemmaRMSNorm`` / ``Gemma3RMSNorm`` under
    ``model`` to its own ``forward_cuda`` over the CPU ops; returns how many. Off CUDA
    only (a no-op returning 0 where the real kernels exist)."""
    from sglang.srt.layers import layernorm

    from harness.standins.kernels import has_real_kernels

    if has_real_kernels():
        return 0
    for name, value in _BINDINGS.items():
        if name not in vars(layernorm):
            setattr(layernorm, name, value)
    classes = tuple(getattr(layernorm, name) for name in NORM_CLASSES)
    n = 0
    for sub in model.modules():
        if type(sub) in classes:
            sub._forward_method = _counted(sub.forward_cuda)
            n += 1
    return n


def _counted(forward_cuda):
    """``forward_cuda``, each call counted as ``norm_forward_cuda`` (whatever kernel, or
    ``forward_native``, SGLang's CUDA dispatch then picks)."""
    import functools

    @functools.wraps(forward_cuda)
    def forward(*args, **kwargs):
        _record("norm_forward_cuda")
        return forward_cuda(*args, **kwargs)

    return forward
