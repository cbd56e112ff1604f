"""Pure-torch versions of GPU kernels that SGLang's models call with no CPU path.

One module per kernel group, each the same op as the GPU kernel (same arguments, same
outputs, same in-place updates), each with a unit test in ``tests/standins/`` against
the op's definition. The HF parity tier installs them through a family's ``setup``
hook (``harness.parity.families``); nothing here is used on a GPU.
"""

from typing import Any, Mapping

_LIB: Any = None


def register_ops(schemas: Mapping[str, str], impls: Mapping[str, Any]) -> list[str]:
    """Register each op of ``schemas`` (name -> schema) that ``torch.ops.sgl_kernel``
    lacks, with ``impls[name]`` as its CPU kernel; returns the names registered.
    Idempotent (one ``sgl_kernel`` fragment library for every module here)."""
    global _LIB
    import torch

    if _LIB is None:
        _LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
    done = []
    for name, schema in schemas.items():
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        _LIB.define(schema)
        _LIB.impl(name, impls[name], "CPU")
        done.append(name)
    return done
