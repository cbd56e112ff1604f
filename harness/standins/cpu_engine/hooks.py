"""Post-import hooks: run a function right after a named module has executed.

The CPU engine's patches must be in place before any other module copies a name out
of the patched one (``from sglang.srt.speculative.eagle_utils import
verify_tree_greedy_func``), and SGLang decides ``is_cpu()`` once, at import. So the
patches are not applied after the fact: ``when_imported(name, fn)`` puts a finder
first on ``sys.meta_path`` that wraps the module's real loader, runs ``fn(module)``
as soon as the module body has run, and then hands the module its real loader back
(``inspect``, ``linecache`` and Triton's source lookup see the ordinary loader).

A hook that raises fails the import of its module, with the hook's error: a patch
whose target moved is a loud import error, never a silently unpatched module.

Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable, Sequence

Hook = Callable[[ModuleType], None]

_LOCK = threading.RLock()
_HOOKS: dict[str, list[Hook]] = {}


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then the hooks; restores the real loader on the module."""

    def __init__(self, real: importlib.abc.Loader, name: str) -> None:
        self.real = real
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        self.real.exec_module(module)
        with _LOCK:
            hooks = _HOOKS.pop(self.name, [])
        for hook in hooks:
            hook(module)

    def __getattr__(self, attr: str):  # get_source, is_package, ... of the real loader
        return getattr(self.real, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; answers only for names that have pending hooks."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        with _LOCK:
            if fullname not in _HOOKS:
                return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _Finder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                    return spec
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_FINDER = _Finder()


def when_imported(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` once module ``name`` has executed; now if it already has."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    with _LOCK:
        _HOOKS.setdefault(name, []).append(hook)
        if not any(f is _FINDER for f in sys.meta_path):
            sys.meta_path.insert(0, _FINDER)


def pending() -> list[str]:
    """Module names whose hooks have not run yet (their module was not imported)."""
    with _LOCK:
        return sorted(_HOOKS)
