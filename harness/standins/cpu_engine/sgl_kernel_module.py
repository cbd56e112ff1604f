"""A stand-in for sgl-kernel's CPU build, used when the real ``sgl_kernel`` cannot load.

On a CPU engine SGLang 0.5.23 imports ``*_cpu`` ops from ``sgl_kernel`` at module level
(``kernels/ops/kvcache/cache_move.py`` imports ``copy_all_layer_kv_cache_cpu`` as soon
as ``mem_cache.memory_pool`` is imported). The sgl-kernel wheel the locks install is the
CUDA build, which needs ``libcuda.so.1``: without a GPU driver its import raises
ImportError, and with it every CPU-engine import of the memory pool.

``install_finder()`` puts a finder first on ``sys.meta_path`` that, when ``sgl_kernel``
is imported, runs the real package; only if that raises ImportError or OSError does the
module become this stand-in (the real package's half-imported submodules are removed,
the failure is kept as ``__standin_reason__``). A machine with a loadable sgl-kernel
(a GPU, or sgl-kernel's CPU build) gets the real one.

The stand-in is a plain module (not a package) holding exactly the ops in ``OPS``, each
a pure-torch version with a unit test in ``tests/standins/``. Any other name raises
AttributeError naming it (``from sgl_kernel import x`` then fails as an ImportError
naming ``x``), and ``import sgl_kernel.<sub>`` fails: code that needs an op this
stand-in lacks stops there, never runs a placeholder. ``torch.ops.sgl_kernel`` is left
alone, so SGLang's ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` AMX probe
stays False and the AMX paths stay off.

Safe at the pin: sglang 0.5.13.post1 imports ``sgl_kernel`` on the CPU only to probe for
AMX (``utils/common.py``) and takes no ``*_cpu`` op from it.

Standard library only at import time.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Sequence

NAME = "sgl_kernel"

# sgl_kernel name -> "module:function" under harness.standins.cpu_engine
OPS: dict[str, str] = {
    "assign_req_to_token_pool_cpu": "cache_locs:assign_req_to_token_pool",
    "assign_extend_cache_locs_cpu": "cache_locs:assign_extend_cache_locs",
    "assign_draft_cache_locs_contiguous_cpu": "cache_locs:assign_draft_cache_locs_contiguous",
    "fill_bonus_tokens_cpu": "cache_locs:fill_bonus_tokens",
    "fill_accept_out_cache_loc_cpu": "cache_locs:fill_accept_out_cache_loc",
    "copy_all_layer_kv_cache_cpu": "kv_copy:copy_all_layer_kv_cache",
    "build_tree_kernel_efficient_cpu": "tree:build_tree_kernel_efficient",
    "verify_tree_greedy_cpu": "tree:verify_tree_greedy",
}
_PACKAGE = __name__.rpartition(".")[0]


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), attr)


def _missing(name: str):
    raise AttributeError(
        f"module 'sgl_kernel' (CPU stand-in, harness.standins.cpu_engine) has no op {name!r}: "
        f"only {', '.join(sorted(OPS))} stand in"
    )


def fill(module: ModuleType, reason: str) -> ModuleType:
    """Make ``module`` the stand-in: its ops, a refusing ``__getattr__``, no ``__path__``."""
    keep = {"__name__", "__loader__", "__spec__"}
    for key in [k for k in vars(module) if k not in keep]:
        delattr(module, key)
    module.__doc__ = "CPU stand-in for sgl_kernel (harness.standins.cpu_engine); see __standin_reason__"
    module.__file__ = __file__
    module.__standin__ = True
    module.__standin_reason__ = reason
    module.__version__ = "0.0.0+cpu-standin"
    if module.__spec__ is not None:
        module.__spec__.submodule_search_locations = None
    for name, target in OPS.items():
        setattr(module, name, _resolve(target))

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        _missing(name)

    module.__getattr__ = __getattr__
    return module


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader | None) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        reason = "no sgl_kernel package is installed"
        if self.real is not None:
            module.__loader__ = self.real
            try:
                self.real.exec_module(module)
                if module.__spec__ is not None:
                    module.__spec__.loader = self.real
                return
            except (ImportError, OSError) as exc:
                detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
                reason = f"the real sgl_kernel failed to import: {type(exc).__name__}: {detail[:400]}"
            for sub in [m for m in sys.modules if m.startswith(NAME + ".")]:
                del sys.modules[sub]
            module.__loader__ = self
        fill(module, reason)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NAME:
            return None
        real = None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _Finder):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                real = spec
                break
        if real is not None and real.loader is not None and hasattr(real.loader, "exec_module"):
            real.loader = _Loader(real.loader)
            return real
        return importlib.machinery.ModuleSpec(NAME, _Loader(None), origin=__file__)


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once). If ``sgl_kernel`` was imported
    already, leave it: the real one loaded, or its failure is what the caller saw."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def is_standin(module: ModuleType | None = None) -> bool:
    """Whether ``sgl_kernel`` (imported) is this stand-in."""
    module = module if module is not None else sys.modules.get(NAME)
    return bool(getattr(module, "__standin__", False))
