"""``test``: run the CPU suites with pytest-xdist (junit XML in build/results/)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from harness.patchset.layout import layout


# Arguments this verb does not know go to pytest, in order (`make test ARGS='-k comm'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options of its own: every argument goes to pytest."""


def run(args: argparse.Namespace) -> int:
    lay = layout()
    extra = args.passthrough
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    has_path = any(not a.startswith("-") and (lay.root / a.split("::")[0]).exists() for a in extra)
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "auto", "--dist", "loadgroup", "--junitxml", str(results / "junit.xml")]
    cmd += extra + ([] if has_path else ["tests"])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=lay.root).returncode
