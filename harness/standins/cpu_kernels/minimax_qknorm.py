"""MiniMax-M2's TP-aware q/k RMSNorm kernels on the CPU: ``rms_sumsq_serial`` and
``rms_apply_serial``.

SGLang's ``MiniMaxM2QKRMSNorm`` (``models/minimax_m2.py``: pin 388-483, 0.5.23
393-488) normalises q and k over *all* heads (``qk_norm_type="per_layer"``) while each
rank holds only its heads: ``_forward_naive`` (pin 454, 0.5.23 459) computes per-row
sums of squares of its shards (``rms_sumsq_serial``), all-reduces them over the
attention TP group, and applies the norm (``rms_apply_serial``). Both are Triton
kernels whose wrappers assert CUDA tensors (pin 200 and 247, 0.5.23 205 and 252).
SGLang's CPU path (``_forward_cpu``: ``MiniMaxM2RMSNormTP`` in torch) is chosen only
when ``cpu_has_amx_support()`` (pin 417, 0.5.23 422), i.e. with sgl-kernel's CPU build,
which this machine does not have; so the naive path is what runs, and these are its
two kernels in torch.

Definitions (the Triton kernels ``rmsnorm_sumsq_kernel_serial`` and
``rmsnorm_apply_kernel_serial``), for ``x1: [B, D1]``, ``x2: [B, D2]``:

* ``rms_sumsq_serial(x1, x2)``: a fresh float32 vector of ``ceil(2B / 4) * 4``
  entries (padded for the custom all-reduce's 16-byte alignment): entry ``i < B`` is
  ``sum(x1[i].float() ** 2)``, entry ``B + i`` is ``sum(x2[i].float() ** 2)``; the
  padding is never read (the kernel leaves it uninitialised; here it is zero).
* ``rms_apply_serial(x1, x2, w1, w2, sum_sq, tp_world, eps)``: fresh ``out1``/``out2``
  in the inputs' dtypes, ``out1[i] = (x1[i].float() * rsqrt(sum_sq[i] / D1 / tp_world
  + eps) * w1.float()).to(x1.dtype)`` (``sum_sq`` is the sum over every rank, each
  holding ``D1`` of the ``D1 * tp_world`` columns), likewise ``out2`` with
  ``sum_sq[B + i]``. Nothing is updated in place.

:func:`install` routes ``_forward_naive`` to these (it calls them by their module
names). Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any

MODULE = "sglang.srt.models.minimax_m2"


def _check_rows(op: str, x1, x2) -> None:
    if x1.dim() != 2 or x2.dim() != 2:
        raise ValueError(f"{op}: x1 and x2 must be 2-D, got {tuple(x1.shape)} and {tuple(x2.shape)}")
    if x1.shape[0] != x2.shape[0]:
        raise ValueError(f"{op}: x1 has {x1.shape[0]} rows, x2 {x2.shape[0]}")


def rms_sumsq_serial(x1, x2):
    """Per-row sums of squares of ``x1`` then ``x2`` (float32), padded to a multiple of 4."""
    import torch

    _check_rows("rms_sumsq_serial", x1, x2)
    b = x1.shape[0]
    padded = (2 * b + 3) // 4 * 4
    sum_sq = torch.zeros(padded, device=x1.device, dtype=torch.float32)
    sum_sq[:b] = x1.to(torch.float32).pow(2).sum(dim=-1)
    sum_sq[b:2 * b] = x2.to(torch.float32).pow(2).sum(dim=-1)
    return sum_sq


def rms_apply_serial(x1, x2, w1, w2, sum_sq, tp_world: int = 1, eps: float = 1e-5):
    """``(out1, out2)``: ``x * rsqrt(sum_sq / (D * tp_world) + eps) * w`` per row, fresh."""
    import torch

    _check_rows("rms_apply_serial", x1, x2)
    b, d1 = x1.shape
    d2 = x2.shape[1]
    if w1.shape != (d1,) or w2.shape != (d2,):
        raise ValueError(f"rms_apply_serial: weights {tuple(w1.shape)}, {tuple(w2.shape)} "
                         f"for rows of {d1} and {d2}")
    if sum_sq.numel() < 2 * b:
        raise ValueError(f"rms_apply_serial: sum_sq has {sum_sq.numel()} entries, needs {2 * b}")
    s = sum_sq.to(torch.float32)
    inv1 = torch.rsqrt(s[:b] / d1 / tp_world + eps).unsqueeze(-1)
    inv2 = torch.rsqrt(s[b:2 * b] / d2 / tp_world + eps).unsqueeze(-1)
    out1 = (x1.to(torch.float32) * inv1 * w1.to(torch.float32)).to(x1.dtype)
    out2 = (x2.to(torch.float32) * inv2 * w2.to(torch.float32)).to(x2.dtype)
    return out1.contiguous(), out2.contiguous()


_SAVED: dict[str, Any] = {}


def install() -> None:
    """Route ``MiniMaxM2QKRMSNorm._forward_naive`` to these kernels (a family ``setup``
    hook; idempotent). A no-op on a CUDA machine, where the Triton kernels run."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return
    mod = importlib.import_module(MODULE)
    for name, fn in (("rms_sumsq_serial", rms_sumsq_serial),
                     ("rms_apply_serial", rms_apply_serial)):
        current = getattr(mod, name)
        if current is not fn:
            _SAVED.setdefault(name, current)
            setattr(mod, name, fn)


def uninstall() -> None:
    """Put SGLang's own kernels back."""
    import importlib

    mod = importlib.import_module(MODULE)
    for name, fn in _SAVED.items():
        setattr(mod, name, fn)
    _SAVED.clear()
