"""Which SGLang version the stand-ins serve, and where that version's own parts live.

SGLang changed its internals between the pin and later releases (0.5.23 replaced the
LayerCommunicator by ``layers/layer_boundary``, the server-args globals by a runtime
context), so the parts that touch those internals exist per SGLang version: the pin's
in ``harness.standins`` (kernels, models) and ``harness.ranks.sglang``, a later
version's in ``harness.standins.v<version with _>`` (``dist``, ``kernels``, ``models``).

They follow the version, not the role: the active base is ``$HARNESS_BASE`` (``make ...
BASE=0.5.23``) or the pin, and its version picks the package, so a base promoted to be
the pin (README, "Moving the pin") keeps its stand-ins.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType


@functools.lru_cache(maxsize=None)
def active() -> str:
    """The active base's SGLang version (its pin.json)."""
    from harness.patchset.layout import layout

    return layout().label


def package() -> str | None:
    """``harness.standins.v0_5_23`` when the active version has a package of its own;
    None when the default parts (``harness.standins``) serve it."""
    name = "harness.standins.v" + active().replace(".", "_")
    return name if importlib.util.find_spec(name) is not None else None


def module(name: str) -> ModuleType | None:
    """The active version's own ``<package>.<name>``, or None for the default parts."""
    pkg = package()
    return None if pkg is None else importlib.import_module(f"{pkg}.{name}")
