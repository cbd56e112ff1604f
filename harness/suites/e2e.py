"""``e2e``: the real-engine tier, SGLang's own ``sglang.Engine`` on the CPU (tests/e2e).

Runs pytest on tests/e2e with ``--e2e`` in one process (the tier's Engines run in a
driver process of their own, one configuration at a time), JUnit XML into the base's
results dir (``build/results/e2e.xml``; ``e2e-partial.xml`` when the arguments select
tests), engine timings beside it (``e2e-timings.json``). The patched SGLang is the
installed wheel, or ``HARNESS_SGLANG_PATH``'s tree when set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from harness.patchset.layout import layout
from harness.suites.test import selects

# Arguments this verb does not know go to pytest, in order (`make e2e ARGS='-k llama'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options of its own: every argument goes to pytest."""


def run(args: argparse.Namespace) -> int:
    lay = layout()
    extra = args.passthrough
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    has_path = any(not a.startswith("-") and (lay.root / a.split("::")[0]).exists() for a in extra)
    partial = has_path or selects(extra)
    junit = results / ("e2e-partial.xml" if partial else "e2e.xml")
    env = dict(os.environ)
    env.setdefault("HARNESS_E2E_TIMINGS", str(results / ("e2e-timings-partial.json" if partial else "e2e-timings.json")))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "--e2e", "-rfEs", "--junitxml", str(junit)]
    cmd += extra + ([] if has_path else ["tests/e2e"])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=lay.root, env=env).returncode
