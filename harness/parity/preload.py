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

import os

from harness.parity.runner import ENV

os.environ.update(ENV)

from harness.ranks.sglang import preload  # noqa: E402
from harness.standins.cpu_engine import install  # noqa: E402
from harness.standins.cpu_kernels import qwen3_5 as _qwen3_5_ops  # noqa: E402

install()
_qwen3_5_ops.install()
preload((
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader",
    "sglang.srt.models.registry",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.attention.triton_backend",
))
