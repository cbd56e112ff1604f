"""Helpers that run inside ``docker build`` (``python -m harness.docker CMD``).

- :func:`apply_onto`: apply ``patches/series`` onto an existing SGLang git checkout (the
  one inside ``lmsysorg/sglang``) with the tooling's zero-fuzz ``git am --no-3way``.
- :func:`lock_subset`: the hashed lock entries of a few packages.

Stdlib only: the GPU image runs these with the image's own Python.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from harness import HarnessError, progress
from harness.patchset.layout import Layout, layout


def apply_onto(tree: Path, lay: Layout | None = None, allow_base_mismatch: bool = False, series_id: str | None = None) -> list[str]:
    """Apply patches/series onto an existing SGLang git checkout (e.g. the GPU image's).

    Checks the checkout is clean and at the pinned commit (unless ``allow_base_mismatch``),
    then applies each patch with the tooling's zero-fuzz ``git am --no-3way``; a failure
    is one line naming the patch, file and hunk. Returns the applied patch names.
    """
    from harness.patchset.git import git
    from harness.patchset.pin import load_pin
    from harness.patchset.series import read_series

    lay = lay or layout()
    tree = tree.resolve()
    if not (tree / ".git").exists():
        raise HarnessError(f"{tree}: not a git checkout (no .git)")
    pin = load_pin(lay)
    want = pin.get("git", {}).get("commit")
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if want and head != want:
        msg = f"{tree}: HEAD is {head}, pin.json wants {want} (tag {pin.get('git', {}).get('tag')})"
        if not allow_base_mismatch:
            raise HarnessError(msg + "; pass --allow-base-mismatch (ALLOW_BASE_MISMATCH=1) to apply anyway")
        progress(f"warning: {msg}; applying anyway")
    dirty = git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        first = dirty.splitlines()[0].strip()
        raise HarnessError(f"{tree}: checkout has local changes ({first} ...); the series needs a clean tree")
    names = read_series(lay)
    if not names:
        progress("patches/series lists no patches: nothing to apply")
        return []
    try:
        from harness.patchset.apply import apply_one
    except ImportError:  # tooling not there: same semantics, coarser error
        apply_one = _apply_one_fallback
    for i, name in enumerate(names, 1):
        progress(f"  [{i}/{len(names)}] {name}")
        apply_one(tree, lay.patches / name)
    if series_id:
        git(tree, "tag", "-f", f"auxcap/{series_id}")
    progress(f"applied {len(names)} patch(es) onto {tree}")
    return names


def _apply_one_fallback(tree: Path, patch: Path) -> None:
    from harness.patchset.git import git

    if not patch.exists():
        raise HarnessError(f"{patch.name}: listed in series but missing")
    am = git(tree, "am", "--keep-cr", "--no-3way", str(patch), check=False)
    if am.returncode != 0:
        git(tree, "am", "--abort", check=False)
        out = am.stdout + am.stderr
        m = re.search(r"^error: patch failed: (.+):(\d+)$", out, re.M)
        where = f"{m.group(1)}: hunk at line {m.group(2)}" if m else "does not apply"
        raise HarnessError(f"{patch.name}: {where}")


def lock_subset(lock: Path, names: list[str]) -> str:
    """The blocks of a hashed lock file for ``names`` (for pip --require-hashes --no-deps)."""
    want = {n.lower().replace("_", "-") for n in names}
    out: list[str] = []
    keep = False
    found: set[str] = set()
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==", line)
        if m:
            name = m.group(1).lower().replace("_", "-")
            keep = name in want
            if keep:
                found.add(name)
        elif not line.startswith(" "):
            keep = False
        if keep and not line.lstrip().startswith("#"):
            out.append(line)
    missing = sorted(want - found)
    if missing:
        raise HarnessError(f"{lock}: no pin for {', '.join(missing)}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.docker apply-onto DIR | lock-subset LOCK NAME...`` (used in docker build)."""
    p = argparse.ArgumentParser(prog="python -m harness.docker")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply-onto", help="apply patches/series onto an existing SGLang git checkout")
    a.add_argument("tree", type=Path)
    a.add_argument("--allow-base-mismatch", action="store_true")
    a.add_argument("--series-id")
    s = sub.add_parser("lock-subset", help="print the hashed lock entries of the named packages")
    s.add_argument("lock", type=Path)
    s.add_argument("names", nargs="+")
    args = p.parse_args(argv)
    try:
        if args.cmd == "apply-onto":
            apply_onto(args.tree, allow_base_mismatch=args.allow_base_mismatch, series_id=args.series_id)
        else:
            sys.stdout.write(lock_subset(args.lock, args.names))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
