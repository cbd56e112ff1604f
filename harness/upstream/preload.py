"""Imported once by pr-export's forkserver (``harness.upstream.prexport``): the
third-party packages a bundle's unit test imports through SGLang (about 45 s of a 50 s
run on 2 cores), so each run forks with them loaded and imports only SGLang itself,
from the clean tree it verifies. SGLang is never imported here: every run must take it
from its own tree.
"""

import importlib
import sys

_MODULES = (
    "torch",
    "transformers",
    "flashinfer",
    "cutlass",
    "sympy",
    "pandas",
    "scipy",
    "torchvision",
    "triton",
    "datasets",
    "networkx",
    "aiohttp",
    "numpy",
)

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # absent or broken without a GPU: the run imports it itself
        pass

assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules), (
    "a preloaded package imported sglang; runs must import it from their own tree"
)
