"""SGLang's CPU engine mode on a machine without a GPU: ``install()``.

Call ``install()`` first thing in a process, before SGLang is imported (it raises if a
``sglang.srt`` module was imported without it). It is idempotent and imports only the
standard library; torch and SGLang are patched as they get imported. It:

1. sets ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's ``is_cpu()``, decided at each module's
   import) and ``TRITON_INTERPRET=1`` (Triton has no CPU driver: SGLang's few Triton
   kernels on the CPU path, and the triton attention backend the EAGLE worker needs,
   run in Triton's interpreter);
2. makes ``import sgl_kernel`` give a CPU stand-in when the real package cannot load
   (``sgl_kernel_module``: SGLang 0.5.23 imports ``*_cpu`` ops from it as soon as the
   memory pool is imported; the installed sgl-kernel is the CUDA build, which needs
   ``libcuda``);
3. makes ``torch.cuda.synchronize``/``empty_cache`` no-ops without a GPU and
   ``record_stream`` a no-op on CPU tensors (``torch_cpu``), and fixes the Triton
   interpreter's bfloat16 ``tl.dot`` (``triton_interp``);
4. fills the CPU gaps of SGLang's speculative path and KV pool, per module, right after
   each is imported (``sglang_patches``; ``hooks`` is the post-import machinery).

The ops themselves, each a pure-torch version of the GPU op with a unit test in
``tests/standins/``: ``tree`` (EAGLE ``build_tree_kernel_efficient``,
``verify_tree_greedy``), ``cache_locs`` (KV cache-location assignment, accepted-token
bookkeeping), ``kv_copy`` (``copy_all_layer_kv_cache``).

Spawned processes (the Engine's scheduler and detokenizer) start a fresh interpreter, so
they need ``install()`` too: ``site_dir()`` is a directory holding a
``sitecustomize.py`` that calls ``install()`` when ``HARNESS_CPU_ENGINE=1``;
``child_env()`` gives the variables that put it on ``PYTHONPATH``. Python imports
``sitecustomize`` at every interpreter start, before any user code, so every child,
however SGLang starts it (spawn, forkserver, a subprocess), is in the mode before it
imports SGLang; nothing depends on the parent's ``__main__`` being re-importable, as
re-importing a driver script would.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

ENV_FLAG = "HARNESS_CPU_ENGINE"
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "TRITON_INTERPRET": "1",
}

_LOCK = threading.Lock()
_INSTALLED = False


def install() -> None:
    """Put this process in SGLang's CPU engine mode (see the module docstring)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        early = sorted(m for m in sys.modules if m == "sglang.srt" or m.startswith("sglang.srt."))
        if early:
            raise RuntimeError(
                "harness.standins.cpu_engine.install() must run before SGLang is imported; "
                f"already imported: {', '.join(early[:3])}{' ...' if len(early) > 3 else ''}"
            )
        os.environ.update(ENV)
        os.environ[ENV_FLAG] = "1"  # children started from here install too
        from harness.standins.cpu_engine import hooks, sgl_kernel_module, sglang_patches

        sgl_kernel_module.install_finder()
        hooks.when_imported("torch", _patch_torch)
        hooks.when_imported("triton.runtime.interpreter", _patch_triton_interpreter)
        sglang_patches.register()
        _INSTALLED = True


def _patch_torch(torch) -> None:
    from harness.standins.cpu_engine import torch_cpu

    torch_cpu.patch(torch)


def _patch_triton_interpreter(interpreter) -> None:
    from harness.standins.cpu_engine import triton_interp

    triton_interp.patch(interpreter)


def installed() -> bool:
    return _INSTALLED


def site_dir() -> Path:
    """The directory whose ``sitecustomize.py`` calls ``install()`` (``HARNESS_CPU_ENGINE=1``)."""
    return Path(__file__).resolve().parent / "site"


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) plus what a child process needs to start in the
    mode: ``HARNESS_CPU_ENGINE=1``, the site dir and the harness's root on ``PYTHONPATH``
    (first), and ``ENV``."""
    env = dict(os.environ if base is None else base)
    root = str(Path(__file__).resolve().parents[3])
    paths = [str(site_dir()), root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    seen: list[str] = []
    for p in paths:
        if p not in seen:
            seen.append(p)
    env["PYTHONPATH"] = os.pathsep.join(seen)
    env[ENV_FLAG] = "1"
    env.update(ENV)
    return env


__all__ = ["install", "installed", "site_dir", "child_env", "ENV", "ENV_FLAG"]
