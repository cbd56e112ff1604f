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

import importlib
import os
import time

from harness.parity.runner import ENV

_t0 = time.monotonic()
os.environ.update(ENV)

from harness.standins.cpu_engine import install  # noqa: E402
from harness.standins.cpu_kernels import qwen3_5 as _qwen3_5_ops  # noqa: E402

install()
_qwen3_5_ops.install()

_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader",
    "sglang.srt.models.registry",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.attention.triton_backend",
)
for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # another base lays SGLang out differently: the rank imports it
        pass

from harness.ranks.sglang import _log_import  # noqa: E402

_log_import(-1, 0, True, time.monotonic() - _t0)
