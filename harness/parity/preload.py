"""Imported once by the parity pools' forkserver: SGLang in its CPU engine mode.

A parity rank (:func:`harness.parity.runner.init`) needs the CPU engine mode before
SGLang is imported (SGLang decides its platform at import), so its ranks cannot fork
from the "sglang" pools' forkserver. A pytest worker drives either those pools or the
parity tier (``tests/conftest.py``'s groups), so the parity worker's forkserver is this
one: the mode, the ops the model modules bind at import, then SGLang's heavy modules,
once, instead of every rank importing them after a spawn (about 40 s of CPU each on
0.5.23). Nothing is initialised here (no process group); a module that the SGLang under
test lacks (another base) is skipped.
"""

from harness.parity.runner import cpu_engine_mode
from harness.ranks.sglang import CORE_MODULES, preload

cpu_engine_mode()
preload(CORE_MODULES + (
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader",
    "sglang.srt.models.registry",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.attention.triton_backend",
))
