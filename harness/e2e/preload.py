"""Imported once by the e2e driver's forkserver (``harness.e2e.driver``): the modules a
scheduler or detokenizer process imports, so each of them forks with SGLang loaded.

The forkserver starts as a fresh interpreter with the driver's environment, so
``sitecustomize`` has put it in the CPU engine mode before this runs. Nothing is
initialised here. A module the SGLang under test lacks (another base) is skipped.
"""

import importlib

_MODULES = (
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.dflash_worker",
    "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.dflash",
)

for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
