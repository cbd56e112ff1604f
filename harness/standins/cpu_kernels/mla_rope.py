"""Plain RoPE for MLA attention on the CPU: ``get_rope_cpu`` with ``rope_scaling=None``.

``DeepseekV2AttentionMLA`` (deepseek_v2.py; also built by glm4_moe_lite and
longcat_flash) takes its rotary embedding from ``get_rope_wrapper(...,
device=server_args.device)`` (``layers/rotary_embedding/factory.py``), which on the CPU
calls ``get_rope_cpu``. That factory builds DeepSeek's yarn only: it asserts
``rope_scaling is not None`` and ``rope_type == "deepseek_yarn"`` (pin factory.py
379-383, 0.5.23 the same function). An MLA model with plain RoPE has no CPU path there;
LongCat-Flash is one (its decoder layer passes ``rope_scaling=None`` to every attention
at the pin, longcat_flash.py 334; its released config has no rope scaling).

The op for ``rope_scaling=None`` is the one ``get_rope`` builds on every other device
(factory.py ``get_rope``: a plain ``RotaryEmbedding``), and that module has a CPU path
of its own (``RotaryEmbedding.forward_cpu``: sgl-kernel's ``rotary_embedding_cpu`` with
the AMX build, else ``forward_native``). :func:`install` wraps ``get_rope_cpu`` to build
exactly that for ``rope_scaling=None`` and leaves every other call to SGLang's own
function. Nothing here computes a rotation; the unit test checks the module it returns
against the definition of RoPE (neox and interleaved pairs).

Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any, Optional

MODULE = "sglang.srt.layers.rotary_embedding.factory"

_ORIGINAL: dict[str, Any] = {}


def get_rope_cpu(head_size: int, rotary_dim: int, max_position: int, base: int,
                 is_neox_style: bool = True, rope_scaling: Optional[dict] = None,
                 dtype: Any = None, partial_rotary_factor: float = 1.0,
                 device: Optional[str] = None):
    """SGLang's ``get_rope_cpu``, plus plain RoPE (``get_rope``'s ``RotaryEmbedding``)
    where it asserts ``rope_scaling is not None``."""
    import importlib

    factory = importlib.import_module(MODULE)
    if rope_scaling is None:
        return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style,
                                None, dtype, partial_rotary_factor)
    original = _ORIGINAL.get("get_rope_cpu", factory.get_rope_cpu)
    return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling,
                    dtype, partial_rotary_factor, device)


def install() -> None:
    """Route ``factory.get_rope_cpu`` through :func:`get_rope_cpu` (a family ``setup``
    hook; idempotent). ``get_rope_wrapper`` looks it up in the factory module at call
    time, so every MLA model built afterwards gets it."""
    import importlib

    factory = importlib.import_module(MODULE)
    if factory.get_rope_cpu is not get_rope_cpu:
        _ORIGINAL.setdefault("get_rope_cpu", factory.get_rope_cpu)
        factory.get_rope_cpu = get_rope_cpu


def uninstall() -> None:
    """Put SGLang's own ``get_rope_cpu`` back."""
    import importlib

    factory = importlib.import_module(MODULE)
    if "get_rope_cpu" in _ORIGINAL:
        factory.get_rope_cpu = _ORIGINAL.pop("get_rope_cpu")
