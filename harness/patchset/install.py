"""``install-wheel``: install the patched wheel into the running interpreter's env.

No-op when importlib.metadata already reports the patched version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

from harness import HarnessError, progress
from harness.patchset.layout import layout
from harness.patchset.pin import load_pin


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-build", action="store_true", help="do not run build-wheel first")


def run(args: argparse.Namespace) -> int:
    from harness.patchset.wheel import build_wheel, wheel_path

    lay = layout()
    path, version = wheel_path(lay)
    pkg = load_pin(lay)["package"]
    try:
        have = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have == version:
        progress(f"{pkg} {version} already installed")
        return 0
    if not args.no_build:
        path = build_wheel(lay)
    elif not path.exists():
        raise HarnessError(f"{lay.rel(path)}: missing; run `make wheel`")
    try:
        from harness.patchset.lock import find_uv

        cmd = find_uv() + ["pip", "install", "--no-deps", "--python", sys.executable, str(path)]
    except HarnessError:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", str(path)]
    progress(f"installing {path.name} ({have or 'no sglang'} -> {version})")
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise HarnessError(f"installing {path.name} failed (exit {proc.returncode})")
    return 0
