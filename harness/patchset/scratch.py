"""Scratch trees under build/ that never outlive their process.

Every verb that builds something next to build/sglang (a new tree, a check tree, a
rebase tree, a release tree) takes its scratch folder from :func:`scratch`:
``build/.<kind>-<pid>-<random>``. The folder goes away when the block ends, on an
exception, and on SIGTERM/SIGHUP (the CLI turns them into :class:`Terminated`, so
``finally`` blocks run). A process killed outright (SIGKILL, OOM, power) cannot clean
up; the next :func:`scratch` call reaps every folder whose process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from typing import Iterator

# .<kind>-<pid>-<random> (mkdtemp) or .<kind>-<pid> (a renamed-away tree).
_SCRATCH_RE = re.compile(r"^\.(?P<kind>[a-z][a-z-]*?)-(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?$")
# Names an older harness used, without a pid: always stale.
_LEGACY_RE = re.compile(r"^\.(sglang-new|sglang-old|check|rebase|rebase-hash|hash|upstream|pr)-[A-Za-z0-9_]+$")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived; raised in the main thread so cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def unwind_on_signals() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP unwind the stack like Ctrl-C (main thread)."""
    sigs = (signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.signal(sig, _raise_terminated) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def force_remove(func, path, _exc):  # type: ignore[no-untyped-def]
    """``shutil.rmtree`` onerror: make read-only entries (git objects) writable, retry."""
    try:
        os.chmod(path, stat.S_IWRITE | stat.S_IREAD | stat.S_IEXEC)
        func(path)
    except OSError:
        pass


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, onerror=force_remove)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale(build: Path) -> list[Path]:
    """Scratch folders in ``build`` whose process is gone (or that an older harness left)."""
    if not build.is_dir():
        return []
    out = []
    for entry in sorted(build.iterdir()):
        if not entry.is_dir():
            continue
        m = _SCRATCH_RE.match(entry.name)
        if m and not _alive(int(m.group("pid"))):
            out.append(entry)
        elif not m and _LEGACY_RE.match(entry.name):
            out.append(entry)
    return out


def reap(build: Path) -> list[Path]:
    """Remove the stale scratch folders in ``build``; return what was removed."""
    gone = stale(build)
    for path in gone:
        remove_tree(path)
    return gone


def aside(build: Path, kind: str) -> Path:
    """A scratch path (not created) to rename a tree to before it is removed."""
    return build / f".{kind}-{os.getpid()}"


@contextlib.contextmanager
def scratch(build: Path, kind: str) -> Iterator[Path]:
    """``build/.<kind>-<pid>-XXXX``, removed when the block exits, however it exits."""
    build.mkdir(parents=True, exist_ok=True)
    reap(build)
    path = Path(tempfile.mkdtemp(dir=build, prefix=f".{kind}-{os.getpid()}-"))
    try:
        yield path
    finally:
        remove_tree(path)
