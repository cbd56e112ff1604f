"""Imported once by the rank pools' forkserver (CPU ranks): SGLang's heavy modules.

Each rank then forks from a process that already holds them, instead of spending ~17 s
of CPU importing SGLang after a spawn. Nothing is initialised here (no process group,
no CUDA): that happens per rank, in its init hook. A module that does not exist in the
SGLang under test (another base) is skipped. With ``$HARNESS_IMPORT_LOG`` the import is
logged as rank -1 (``make bench-suite``).
"""

from harness.ranks.sglang import CORE_MODULES, preload

preload(CORE_MODULES + ("sglang.srt.models.deepseek_v2",))
