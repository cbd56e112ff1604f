"""Gemma 4's weight-folded RMSNorm on the CPU, as SGLang's CUDA path computes it.

SGLang's ``Gemma4Router`` (``models/gemma4_causal.py``: pin 133, its norm 155-157 and
``fuse_scale`` 176; 0.5.23 160, 182-184 and 203) builds its norm as ``Gemma4RMSNorm(hidden, with_scale=False)`` and, on the first
forward, folds transformers' ``router.scale * hidden_size ** -0.5`` into that norm's
``weight`` buffer (``fuse_scale``). ``Gemma4RMSNorm.forward_cuda`` (and ``forward_xpu``)
run ``rmsnorm(x, weight)`` whatever ``with_scale`` says, so the folded scale reaches the
router logits there. ``forward_native`` (which ``forward_cpu`` falls back to without
sgl-kernel's AMX build, and ``forward_hip`` calls) multiplies by ``weight`` only when
``with_scale`` (``layers/layernorm.py``: pin 897-901, 0.5.23 1421-1425), so on those
paths the router's logits lose ``scale * hidden_size ** -0.5``: the top-k softmax weights
differ from transformers' (a genuine SGLang bug off CUDA, reported, not fixed here).

:func:`gemma4_rmsnorm` is the CUDA path's result in torch: ``x * (mean(x**2) + eps) **
-0.5``, times ``weight + scale_shift`` when ``with_scale``, times ``weight`` otherwise
(``rmsnorm``; a ``with_scale=False`` norm's weight is ones unless something folded into
it, e.g. the router), in float32, cast back. :func:`install` (the ``gemma4_moe`` parity
family's setup) binds it as the class's CPU entry points before the model is built.
Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["gemma4_rmsnorm", "install", "uninstall", "installed"]

_ENTRY_POINTS = ("forward_native", "forward_cpu")
_ORIGINAL: Optional[dict] = None


def gemma4_rmsnorm(x, weight, eps: float, scale_shift: float = 0.0, with_scale: bool = True):
    """What ``Gemma4RMSNorm.forward_cuda`` computes for ``x`` (fresh tensor, x's dtype)."""
    import torch

    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if with_scale and scale_shift == 1.0:
        out = out * (1.0 + weight.float())  # gemma_rmsnorm
    elif with_scale:
        out = out * (weight.float() + scale_shift)
    else:
        out = out * weight.float()  # rmsnorm(x, weight): the folded router scale
    return out.type_as(x)


def _forward(self, x):
    return gemma4_rmsnorm(x, self.weight, self.eps, self.scale_shift, self.with_scale)


def _cls():
    from sglang.srt.layers.layernorm import Gemma4RMSNorm

    return Gemma4RMSNorm


def installed() -> bool:
    return _ORIGINAL is not None


def install() -> bool:
    """Bind :func:`gemma4_rmsnorm` as ``Gemma4RMSNorm``'s CPU entry points; idempotent.
    Norms built afterwards use it (the op binds its method when it is built)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    cls = _cls()
    _ORIGINAL = {name: cls.__dict__[name] for name in _ENTRY_POINTS if name in cls.__dict__}
    for name in _ENTRY_POINTS:
        setattr(cls, name, _forward)
    return True


def uninstall() -> None:
    global _ORIGINAL
    if _ORIGINAL is None:
        return
    cls = _cls()
    for name in _ENTRY_POINTS:
        if name in _ORIGINAL:
            setattr(cls, name, _ORIGINAL[name])
        else:
            delattr(cls, name)
    _ORIGINAL = None
