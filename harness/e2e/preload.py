"""Imported once by the e2e driver's forkserver (``harness.e2e.driver``): the modules a
scheduler or detokenizer process imports, so each of them forks with SGLang loaded.

The forkserver starts as a fresh interpreter with the driver's environment, so
``sitecustomize`` has put it in the CPU engine mode before this runs. Nothing is
initialised here. A module the SGLang under test lacks (another base) is skipped.

A scheduler that fails signals its parent (``parent_process.send_signal(SIGQUIT)``,
``managers/scheduler.py``), and then exits 0, which the Engine's ``SubprocessWatchdog``
takes for a clean exit. Spawned, its parent is the Engine's process, whose handler takes
the Engine down at once; forked from here, its parent is this forkserver. So the
forkserver hands a SIGQUIT on to its own parent, the driver, where the Engine's handler
runs as it does for a spawned child (``_EnvProcess.run`` puts the default back in each
child). Without it a failed scheduler left the driver waiting out its deadline (600 s).
"""

import importlib
import os
import signal


def _sigquit_to_driver(signum, frame):
    os.kill(os.getppid(), signal.SIGQUIT)


signal.signal(signal.SIGQUIT, _sigquit_to_driver)

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
