"""Imported once by the rank pools' forkserver (CPU ranks): SGLang's heavy modules.

Each rank then forks from a process that already holds them, instead of spending ~17 s
of CPU importing SGLang after a spawn. Nothing is initialised here (no process group,
no CUDA): that happens per rank, in its init hook. A module that does not exist in the
SGLang under test (another base) is skipped. With ``$HARNESS_IMPORT_LOG`` the import is
logged as rank -1 (``make bench-suite``).
"""

import importlib
import time

_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.models.deepseek_v2",
)

_t0 = time.monotonic()
for _name in _MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # another base lays SGLang out differently: the rank imports it
        pass

from harness.ranks.sglang import _log_import  # noqa: E402

_log_import(-1, 0, True, time.monotonic() - _t0)
