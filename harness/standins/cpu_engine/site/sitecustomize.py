"""Started with this directory on PYTHONPATH and ``HARNESS_CPU_ENGINE=1``, every Python
process calls ``harness.standins.cpu_engine.install()`` before any user code: the way
the Engine's spawned scheduler and detokenizer get SGLang's CPU engine mode.

A ``sitecustomize`` further down ``sys.path`` (the interpreter's own) would be shadowed
by this one, so it is run afterwards.
"""

import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_sitecustomize_next", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("HARNESS_CPU_ENGINE") == "1":
    from harness.standins.cpu_engine import install

    install()
_chain()
