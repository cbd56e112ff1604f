"""Imported once by the rank pools' forkserver (CPU ranks): SGLang's heavy modules.

Each rank then forks from a process that already holds them, instead of spending ~17 s
of CPU importing SGLang after a spawn. Nothing is initialised here (no process group,
no CUDA): that happens per rank, in its init hook. A module that does not exist in the
SGLang under test (another base) is skipped. With ``$HARNESS_IMPORT_LOG`` the import is
logged as rank -1 (``make bench-suite``).
"""

from harness.ranks.sglang import preload

preload((
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.models.deepseek_v2",
))
