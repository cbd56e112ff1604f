"""Failure reporting for rank pools: one error that names every failed rank.

A :class:`RankError` carries each raised rank's traceback, each dead rank's exit (signal
or code, plus faulthandler's fatal-signal dump), and, on a deadline, every live rank's
Python stacks (faulthandler on SIGUSR1 into ``<workdir>/rank<N>.stacks``).
Stdlib only.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterable

STACK_SIGNAL = signal.SIGUSR1
MAX_TB_CHARS = 12_000  # per rank, keeps error messages readable


class RankError(RuntimeError):
    """One failed ``RankPool.run``/start. ``kind``: raised | died | timeout | init."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        rank: int | None,
        states: dict[int, str],
        tracebacks: dict[int, str] | None = None,
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.rank = rank
        self.states = states
        self.tracebacks = tracebacks or {}
        self.stacks = stacks or {}

    def __reduce__(self):
        return (_rebuild_rank_error, (str(self), self.kind, self.rank, self.states,
                                      self.tracebacks, self.stacks))


def _rebuild_rank_error(message, kind, rank, states, tracebacks, stacks) -> "RankError":
    return RankError(message, kind=kind, rank=rank, states=states, tracebacks=tracebacks, stacks=stacks)


class PoolBrokenError(RuntimeError):
    """The pool was killed after a failure (or closed); get a new one."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})"
    return f"exited with code {code}"


def read_capped(path: str, limit: int = MAX_TB_CHARS) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if len(text) > limit:
        text = "...[truncated]...\n" + text[-limit:]
    return text


def state_lines(ranks: Iterable[Any]) -> tuple[str, dict[int, str]]:
    """``rank 0: finished, rank 1: dead (killed by SIGKILL (signal 9))`` and the dict."""
    states: dict[int, str] = {}
    for r in ranks:
        s = r.state
        if s == "dead":
            s = f"dead ({r.exit_desc})"
        states[r.rank] = s
    return ", ".join(f"rank {k}: {v}" for k, v in states.items()), states


def collect_stacks(ranks: list[Any], workdir: str, grace: float) -> dict[int, str]:
    """SIGUSR1 -> faulthandler dumps every thread's Python stack to rank<N>.stacks."""
    targets = [r for r in ranks if r.proc.is_alive()]
    for r in targets:
        try:
            open(os.path.join(workdir, f"rank{r.rank}.stacks"), "w").close()
        except OSError:
            pass
        try:
            os.kill(r.pid, STACK_SIGNAL)
        except OSError:
            pass
    stacks: dict[int, str] = {}
    end = time.monotonic() + grace
    while targets and time.monotonic() < end:
        time.sleep(0.05)
        for r in list(targets):
            text = read_capped(os.path.join(workdir, f"rank{r.rank}.stacks"))
            # faulthandler writes "Thread 0x... (most recent call first):" blocks;
            # wait until the file stops growing.
            if text and stacks.get(r.rank) == text:
                targets.remove(r)
            stacks[r.rank] = text
    return stacks


def fatal_dumps(ranks: Iterable[Any], workdir: str) -> dict[int, str]:
    out = {}
    for r in ranks:
        text = read_capped(os.path.join(workdir, f"rank{r.rank}.fatal"))
        if text.strip():
            out[r.rank] = text
    return out


def format_failure(header: str, tracebacks: dict[int, str], stacks: dict[int, str],
                   fatal: dict[int, str]) -> str:
    parts = [header]
    for rank, tb in tracebacks.items():
        parts.append(f"----- rank {rank} traceback -----\n{tb.rstrip()[-MAX_TB_CHARS:]}")
    for rank, text in fatal.items():
        parts.append(f"----- rank {rank} fatal-signal dump (faulthandler) -----\n{text.rstrip()}")
    for rank, text in stacks.items():
        parts.append(f"----- rank {rank} Python stacks at the deadline (faulthandler) -----\n"
                     f"{text.rstrip() or '(no dump: the rank did not answer SIGUSR1)'}")
    return "\n".join(parts)
