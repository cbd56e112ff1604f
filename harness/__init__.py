"""auxcap harness: patch tooling, patched-SGLang builds and regression suites.

Every module that ``harness.cli`` imports must import only the standard library at
module import time; torch and sglang are imported lazily inside the functions that
need them, so ``make apply-patches`` runs on a bare Python 3.11.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class HarnessError(Exception):
    """A user-facing failure: the CLI prints ``error: <message>`` on one line."""


__all__ = ["ROOT", "HarnessError"]
