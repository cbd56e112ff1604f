"""``test``: run the CPU suites with pytest-xdist (junit XML in build/results/).

A whole-suite run writes ``junit.xml`` (what ``rebase --promote`` trusts); a run that
selects tests (a path, ``-k``, ``-m``, ``--deselect``, ``--lf``) writes
``junit-partial.xml`` instead, so it can never stand in for the full suite."""

from __future__ import annotations

import argparse
import subprocess
import sys

from harness.patchset.layout import layout


# Arguments this verb does not know go to pytest, in order (`make test ARGS='-k comm'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options of its own: every argument goes to pytest."""


SELECTING = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--sw", "--stepwise")


def selects(extra: list[str]) -> bool:
    """Whether pytest arguments run only part of the suite (besides a path)."""
    return any(a in SELECTING or a.startswith(tuple(f"{o}=" for o in SELECTING)) or
               (a.startswith(("-k", "-m")) and len(a) > 2) for a in extra)


def run(args: argparse.Namespace) -> int:
    lay = layout()
    extra = args.passthrough
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    has_path = any(not a.startswith("-") and (lay.root / a.split("::")[0]).exists() for a in extra)
    junit = results / ("junit-partial.xml" if has_path or selects(extra) else "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "auto", "--dist", "loadgroup", "--junitxml", str(junit)]
    cmd += extra + ([] if has_path else ["tests"])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=lay.root).returncode
