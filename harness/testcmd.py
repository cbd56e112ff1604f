"""``test``: run the CPU suites with pytest-xdist (junit XML in build/results/)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from harness.common import layout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed through to pytest")


def run(args: argparse.Namespace) -> int:
    lay = layout()
    extra = [a for a in args.pytest_args if a != "--"]
    results = lay.build / "results"
    results.mkdir(parents=True, exist_ok=True)
    has_path = any(not a.startswith("-") and (lay.root / a.split("::")[0]).exists() for a in extra)
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "auto", "--dist", "loadgroup", "--junitxml", str(results / "junit.xml")]
    cmd += extra + ([] if has_path else ["tests"])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=lay.root).returncode
