"""auxcap harness: patch tooling, patched-SGLang builds and regression suites.

Every module that ``harness.cli`` imports must import only the standard library at
module import time; torch and sglang are imported lazily inside the functions that
need them, so ``make apply-patches`` runs on a bare Python 3.11.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class HarnessError(Exception):
    """A user-facing failure: the CLI prints ``error: <message>`` on one line."""


def progress(msg: str) -> None:
    """One line of progress on stdout, flushed (long steps print as they go)."""
    print(msg, flush=True)


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


__all__ = ["ROOT", "HarnessError", "progress", "eprint"]
