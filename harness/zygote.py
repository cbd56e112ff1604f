"""Processes that fork their test runs from one that has imported the third-party
packages SGLang pulls in (torch, transformers, flashinfer, ...: most of a short run's
start-up on 2 cores) once, never SGLang itself (checked: :func:`preload`), so each run
imports SGLang from the tree it tests.

* pr-export's test runner, :class:`Zygote`: a process of its own that forks one child
  per run. Each child puts its clean tree's ``python/`` first on ``sys.path`` and runs
  the test as ``__main__``, as ``python3 <test>`` in that tree would. It is pr-export's
  own (one per process, started at the first run, stopped at exit), unlike
  multiprocessing's forkserver, which every user in a process shares: a rank pool in
  the same process may have started that one with SGLang loaded.
* The ablation's runs (``harness.suites.ablation``) fork from the ablation's own
  process after :func:`preload`; it imports nothing of SGLang either.

Protocol of :class:`Zygote` (one export at a time): the client writes one JSON line per
batch, ``[[tree, test_path, log_path], ...]``; the zygote forks every run of the batch at
once, waits for them all (killing any still running after ``timeout`` seconds: status
124), and answers one JSON line, the exit statuses in order.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = (
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
TIMED_OUT = 124


class Zygote:
    """The client: ``Zygote(timeout).run([(tree, test, log), ...])`` -> statuses."""

    def __init__(self, timeout: float, preload: tuple[str, ...] = PRELOAD) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            x for x in (root, os.environ.get("PYTHONPATH")) if x))
        # Runs go side by side, one per core; as in every suite process, one OpenMP
        # thread each (set before the preload imports torch), unless the caller says.
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote", str(timeout), *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def run(self, runs: list[tuple[Path, str, Path]]) -> list[int]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps([[str(t), p, str(log)] for t, p, log in runs]) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pr-export's test runner exited ({self._proc.wait()})")
        return json.loads(line)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_SHARED: Zygote | None = None


def shared(timeout: float) -> Zygote:
    """This process's zygote, started on first use (its preload costs about 40 s)."""
    global _SHARED
    if _SHARED is None or not _SHARED.alive():
        _SHARED = Zygote(timeout)
        atexit.register(_SHARED.close)
    return _SHARED


def _run_as_main(tree: str, test_path: str, log: str) -> None:
    """In a forked child: stdin from /dev/null, stdout and stderr (file descriptors
    too) to ``log``, the tree's ``python/`` first on ``sys.path``, ``test_path`` as
    ``__main__``; exits with its status (an uncaught exception: 1, as ``python3``)."""
    import runpy
    import traceback

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(tree)
    sys.path.insert(0, os.path.join(tree, "python"))
    sys.argv = [test_path]
    try:
        runpy.run_path(test_path, run_name="__main__")
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def preload(names: tuple[str, ...] | list[str] = PRELOAD) -> None:
    """Import ``names`` in this process, once, before it forks runs; raise when SGLang
    got imported (runs must import it from their own tree)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # absent, or broken without a GPU: a run imports it itself
            pass
    if any(m == "sglang" or m.startswith("sglang.") for m in sys.modules):
        raise SystemExit("a preloaded package imported sglang; runs must import it from their own tree")


def _serve(timeout: float, names: list[str]) -> None:
    preload(names)
    out = sys.stdout
    for line in sys.stdin:
        runs = json.loads(line)
        children: dict[int, int] = {}
        for i, (tree, test_path, log) in enumerate(runs):
            pid = os.fork()
            if pid == 0:
                _run_as_main(tree, test_path, log)
            children[pid] = i
        statuses = [TIMED_OUT] * len(runs)
        deadline = time.monotonic() + timeout
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                statuses[children.pop(pid)] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                for pid in children:
                    os.kill(pid, 9)
                for pid in list(children):
                    os.waitpid(pid, 0)
                    statuses[children.pop(pid)] = TIMED_OUT
            else:
                time.sleep(0.05)
        out.write(json.dumps(statuses) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(float(sys.argv[1]), sys.argv[2:])
