"""Rotary embedding with the CUDA kernel's aliasing (in place), for Llama 4 on the CPU.

SGLang's CUDA rotary path updates ``query`` and ``key`` in place and returns them
(``RotaryEmbedding.forward_cuda``: ``apply_rope_with_cos_sin_cache_inplace``). Its CPU
path does not: ``forward_cpu`` falls back to ``forward_native`` (without sgl-kernel's
AMX build), which builds new tensors with ``torch.cat`` and leaves its inputs as they
were (``layers/rotary_embedding/base.py`` 211-251).

``Llama4Attention.forward`` relies on the CUDA aliasing: it rotates two views of its
fused ``qk`` buffer and discards what the rotary embedding returns
(``q_out_unused, k_out_unused = self.rotary_emb(positions, q_view, k_view)``; only NPU
takes the outputs; pin llama4.py 339-344, 0.5.23 332-337). On SGLang's CPU path every
RoPE layer of Llama 4 therefore attends without rotary positions (an SGLang bug of that
path, reported by the parity tier); on CUDA the views are rotated.

:class:`InPlaceRotary` wraps SGLang's own rotary module: it calls it (the CPU path
computes the rotation) and copies the results into ``query`` and ``key``, then returns
them, as the CUDA kernel does. :func:`install_llama4` makes llama4.py's ``get_rope``
return that wrapper, so only Llama 4's attention is affected (``get_rope`` caches its
modules across models; the cached module itself is not modified).

Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any

LLAMA4 = "sglang.srt.models.llama4"

_SAVED: dict[str, Any] = {}


def _module_class():
    import torch

    class InPlaceRotary(torch.nn.Module):
        """SGLang's rotary module with the CUDA kernel's aliasing: ``query`` and ``key``
        are rotated in place and returned (harness.standins.cpu_kernels.rope_inplace)."""

        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(super().__getattr__("inner"), name)

        def forward(self, positions, query, key, *args, **kwargs):
            q_out, k_out = self.inner(positions, query, key, *args, **kwargs)
            if q_out is not query:
                query.copy_(q_out.reshape(query.shape))
            if k_out is not key:
                key.copy_(k_out.reshape(key.shape))
            return query, key

    return InPlaceRotary


_CLASS: Any = None


def in_place(rotary):
    """``rotary`` (an SGLang rotary module, or None) with the CUDA kernel's aliasing."""
    global _CLASS
    if rotary is None:
        return None
    if _CLASS is None:
        _CLASS = _module_class()
    return _CLASS(rotary)


def install_llama4() -> None:
    """Make llama4.py's ``get_rope`` build :func:`in_place` rotaries (a family ``setup``
    hook; idempotent). A no-op on a CUDA machine, where the real kernel runs."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return
    mod = importlib.import_module(LLAMA4)
    if "get_rope" in _SAVED:
        return
    original = mod.get_rope

    def get_rope(*args, **kwargs):
        return in_place(original(*args, **kwargs))

    _SAVED["get_rope"] = original
    mod.get_rope = get_rope


def uninstall_llama4() -> None:
    import importlib

    mod = importlib.import_module(LLAMA4)
    if "get_rope" in _SAVED:
        mod.get_rope = _SAVED.pop("get_rope")
