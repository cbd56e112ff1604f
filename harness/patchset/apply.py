"""``apply-patches``: fetch + verify the pin, apply the series to build/sglang.

build/sglang is a git repo: the pristine pin commit (tag ``base/v<version>``) then one
commit per patch on branch ``patched``. The build happens in a temp dir next to it and
is swapped in only on full success.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any

from harness import HarnessError, progress
from harness.patchset import pypi, scratch
from harness.patchset.git import BASE_IDENT, BRANCH, git
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import (
    base_tag,
    hash_dir,
    load_pin,
    pin_wheel,
    tree_hash,
    write_pin,
)
from harness.patchset.series import hunk_for_line, read_series, series_id

UNSET = "TO-BE-COMPUTED"
# Bump when the way build/sglang is made changes (am/format-patch flags): forces a rebuild.
TOOL_VERSION = 3
DIRTY_HINT = "run `make export-patches` to keep your work, or `make apply-patches FORCE=1` to discard it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild build/sglang, discarding local changes")
    p.add_argument(
        "--source",
        choices=("wheel", "git"),
        default=os.environ.get("SGLANG_SOURCE") or "wheel",
        help="where the pristine pin comes from (default: wheel; env SGLANG_SOURCE)",
    )
    p.add_argument(
        "--update-lock",
        action="store_true",
        help="(re)compute pin.json source_tree_sha256 from the verified wheel and write it",
    )


def run(args: argparse.Namespace) -> int:
    apply_patches(layout(), force=args.force, source=args.source, update_lock=args.update_lock)
    return 0


# ---------------------------------------------------------------- download


def fetch_wheel(lay: Layout, pin: dict[str, Any], pytag: str = "cp311") -> Path:
    """Return the verified pinned wheel in the cache, downloading it if needed."""
    name, expected = pin_wheel(pin, pytag)
    pkg = pin.get("package", "sglang")

    def url() -> str:
        index = pypi.fetch_index(lay.cache, pkg, offline_ok=False)
        entry = next((f for f in index.get("files", []) if f.get("filename") == name), None)
        if entry is None:
            raise HarnessError(f"{name}: not listed by {index['_url']}; not in cache {lay.cache / name}")
        return pypi.file_url(index, entry)

    return pypi.verified_file(lay.cache, name, expected, url)


# ---------------------------------------------------------------- pristine tree


def extract_wheel_tree(wheel: Path, dest: Path) -> str:
    """Lay the wheel's ``sglang/`` out as ``dest/python/sglang`` (no *.so); return tree hash."""
    entries: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("sglang/") or name.endswith("/") or name.endswith(".so"):
                continue
            data = zf.read(info)
            rel = "python/" + name
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111:
                target.chmod(0o755)
            entries[rel] = hashlib.sha256(data).hexdigest()
    return tree_hash(entries)


def clone_git_source(pin: dict[str, Any], dest: Path) -> None:
    """``git clone --depth 1 --branch <tag>`` the pin, verify the commit, keep ``python/sglang``."""
    info = pin["git"]
    if not info.get("commit"):
        # Nothing to verify the clone against (a base made by `rebase`): refuse before
        # touching the network.
        why = info.get("commit_status") or "git.commit is null"
        raise HarnessError(f"sglang {pin['version']}: pin.json has no git.commit to verify a clone "
                           f"against ({why}); use SGLANG_SOURCE=wheel")
    url = os.environ.get("HARNESS_GIT_URL", info["url"])
    timeout = float(os.environ.get("HARNESS_GIT_TIMEOUT", "30"))
    clone = dest.parent / (dest.name + ".clone")
    env = {"GIT_HTTP_LOW_SPEED_LIMIT": "1000", "GIT_HTTP_LOW_SPEED_TIME": "10"}
    progress(f"  cloning {url} at {info['tag']} (timeout {timeout:.0f}s)")
    try:
        proc = git(
            dest.parent,
            "clone", "-q", "--depth", "1", "--branch", info["tag"], url, str(clone),
            check=False, env=env, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(clone, ignore_errors=True)
        raise HarnessError(f"git clone of {url} timed out after {timeout:.0f}s (unreachable?)") from None
    if proc.returncode != 0:
        shutil.rmtree(clone, ignore_errors=True)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        why = next((x for x in lines if x.startswith("fatal:")), lines[-1] if lines else "?")
        raise HarnessError(f"git clone of {url} at {info['tag']} failed: {why}")
    head = git(clone, "rev-parse", "HEAD").stdout.strip()
    if head != info["commit"]:
        shutil.rmtree(clone, ignore_errors=True)
        raise HarnessError(
            f"pin mismatch: {url} tag {info['tag']} is commit {head}, pin.json says {info['commit']}"
        )
    src = clone / "python" / "sglang"
    if not src.is_dir():
        shutil.rmtree(clone, ignore_errors=True)
        raise HarnessError(f"{url} at {info['tag']}: no python/sglang directory")
    shutil.copytree(src, dest / "python" / "sglang", ignore=shutil.ignore_patterns("*.so"))
    shutil.rmtree(clone, ignore_errors=True)


# ---------------------------------------------------------------- applying


class PatchFailure(HarnessError):
    pass


def _describe_apply_error(patch: Path, output: str) -> str:
    text = patch.read_text(errors="replace")
    m = re.search(r"^error: patch failed: (.+):(\d+)$", output, re.M)
    if m:
        path, line = m.group(1), int(m.group(2))
        return f"{patch.name}: {path}: {hunk_for_line(text, path, line)} does not apply"
    m = re.search(r"^error: (.+?): (does not exist in index|No such file or directory|already exists in working directory|does not match index)$", output, re.M)
    if m:
        return f"{patch.name}: {m.group(1)}: {m.group(2)}"
    m = re.search(r"^error: corrupt patch at line (\d+)$", output, re.M)
    if m:
        return f"{patch.name}: corrupt patch at line {m.group(1)}"
    errs = [x for x in output.splitlines() if x.startswith(("error:", "fatal:"))]
    return f"{patch.name}: " + (errs[0].split(":", 1)[1].strip() if errs else "does not apply")


def apply_one(tree: Path, patch: Path) -> None:
    """Zero-fuzz check, then ``git am --no-3way``. Raises PatchFailure with one line."""
    if not patch.exists():
        raise PatchFailure(f"{patch.name}: listed in series but missing")
    chk = git(tree, "apply", "--check", "--verbose", str(patch), check=False)
    out = chk.stdout + chk.stderr
    if chk.returncode != 0:
        raise PatchFailure(_describe_apply_error(patch, out))
    current = "?"
    for line in out.splitlines():
        m = re.match(r"^Checking patch (.+)\.\.\.$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Hunk #(\d+) succeeded at (\d+)(.*)$", line)
        if m and ("offset" in m.group(3) or "fuzz" in m.group(3)):
            raise PatchFailure(
                f"{patch.name}: {current}: hunk #{m.group(1)} applies only at line {m.group(2)}"
                f"{m.group(3).rstrip('.')}; zero fuzz/offset required, refresh the patch"
            )
    # --keep-cr: patches to files with CRLF endings (apertus.py) keep their CRs.
    am = git(tree, "am", "--keep", "--keep-cr", "--no-3way", "--committer-date-is-author-date", str(patch), check=False)
    if am.returncode != 0:
        git(tree, "am", "--abort", check=False)
        raise PatchFailure(_describe_apply_error(patch, am.stdout + am.stderr))


def build_tree(
    lay: Layout, dest: Path, pin: dict[str, Any], source: str, patches: list[Path], verbose: bool = True
) -> dict[str, Any]:
    """Create ``dest`` (must not exist): pristine pin commit + one commit per patch."""
    dest.mkdir(parents=True)
    wheel_sha = None
    if source == "git":
        clone_git_source(pin, dest)
        tree_sha = hash_dir(dest)
        if pin.get("source_tree_sha256") not in (None, UNSET, tree_sha):
            progress(f"  note: git tree hash {tree_sha[:12]} differs from the wheel tree (generated files)")
    else:
        wheel = fetch_wheel(lay, pin)
        wheel_sha = pin_wheel(pin)[1]
        tree_sha = extract_wheel_tree(wheel, dest)
        expected = pin.get("source_tree_sha256")
        if expected in (None, "", UNSET):
            raise HarnessError(
                f"pin.json source_tree_sha256 is not set (tree is {tree_sha}); run apply-patches --update-lock"
            )
        if expected != tree_sha:
            raise HarnessError(f"source tree hash mismatch: pin.json says {expected}, wheel tree is {tree_sha}")
    git(dest, "init", "-q", f"--initial-branch={BRANCH}")
    # Bytecode written next to the sources (a python run outside tox, which caches it
    # under PYTHONPYCACHEPREFIX) is not a change to the tree.
    (dest / ".git" / "info").mkdir(exist_ok=True)
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.py[co]\n")
    git(dest, "add", "-A", "-f", ".")
    date = f"{pin.get('released', '2026-01-01')}T00:00:00+0000"
    env = {
        "GIT_AUTHOR_NAME": BASE_IDENT[0], "GIT_AUTHOR_EMAIL": BASE_IDENT[1],
        "GIT_COMMITTER_NAME": BASE_IDENT[0], "GIT_COMMITTER_EMAIL": BASE_IDENT[1],
        "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date,
    }
    msg = f"{pin.get('package', 'sglang')} {pin['version']} (pristine pin)\n\nsource_tree_sha256: {tree_sha}\n"
    git(dest, "commit", "-q", "--no-verify", "-m", msg, env=env)
    git(dest, "tag", base_tag(pin))
    for patch in patches:
        apply_one(dest, patch)
        if verbose:
            subj = git(dest, "log", "-1", "--format=%s").stdout.strip()
            progress(f"  applied {patch.name}: {subj}")
    return {
        "tree_sha256": tree_sha,
        "wheel_sha256": wheel_sha,
        "head": git(dest, "rev-parse", "HEAD").stdout.strip(),
        "base": git(dest, "rev-parse", "HEAD~%d" % len(patches) if patches else "HEAD").stdout.strip(),
    }


# ---------------------------------------------------------------- state


def read_state(lay: Layout) -> dict[str, Any] | None:
    try:
        return json.loads(lay.state_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_state(lay: Layout, state: dict[str, Any], tree: Path | None = None) -> None:
    path = (tree or lay.tree) / ".git" / lay.state_file.name
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def tree_problem(lay: Layout, state: dict[str, Any] | None) -> str | None:
    """Why build/sglang is not a clean harness-made tree, or None if it is."""
    tree = lay.tree
    if state is None:
        return f"{lay.rel(tree)} exists but was not made by apply-patches"
    if (tree / ".git" / "rebase-apply").exists():
        return f"{lay.rel(tree)} has a `git am` session in progress"
    status = git(tree, "status", "--porcelain", "--untracked-files=normal").stdout
    if status.strip():
        n = len(status.splitlines())
        return f"{lay.rel(tree)} has {n} uncommitted change(s)"
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if head != state.get("head"):
        return f"{lay.rel(tree)} HEAD {head[:12]} has commits not exported to patches/"
    return None


def apply_patches(lay: Layout, force: bool = False, source: str = "wheel", update_lock: bool = False) -> str:
    """Bring build/sglang up to date. Returns 'up to date' or 'rebuilt'."""
    t0 = time.monotonic()
    pin = load_pin(lay)
    names = read_series(lay)
    sid = series_id(lay)
    for gone in scratch.reap(lay.build):
        progress(f"removed {lay.rel(gone)}, left behind by an apply that was killed")
    state = read_state(lay) if lay.tree.exists() else None
    if lay.tree.exists() and not force:
        problem = tree_problem(lay, state)
        if problem:
            raise HarnessError(f"{problem}; {DIRTY_HINT}")
        assert state is not None
        same = (state.get("series_id"), state.get("source"), state.get("tool")) == (sid, source, TOOL_VERSION)
        if same and not update_lock:
            progress(f"{lay.rel(lay.tree)} up to date (series {sid}, {len(names)} patches)")
            return "up to date"
    if update_lock:
        wheel = fetch_wheel(lay, pin)
        with scratch.scratch(lay.build, "hash") as tmp:
            tree_sha = extract_wheel_tree(wheel, tmp)
        if pin.get("source_tree_sha256") != tree_sha:
            pin["source_tree_sha256"] = tree_sha
            write_pin(lay, pin)
            progress(f"pin.json: source_tree_sha256 = {tree_sha}")
        sid = series_id(lay)
    patches = [lay.patches / n for n in names]
    progress(f"applying {len(patches)} patch(es) onto {pin['package']} {pin['version']} ({source}) -> {lay.rel(lay.tree)}")
    with scratch.scratch(lay.build, "sglang-new") as tmp:
        work = tmp / "sglang"
        info = build_tree(lay, work, pin, source, patches)
        state = {
            "series_id": sid,
            "source": source,
            "tool": TOOL_VERSION,
            "pin_version": pin["version"],
            "patches": names,
            **info,
        }
        write_state(lay, state, work)
        old = None
        if lay.tree.exists():
            old = scratch.aside(lay.build, "sglang-old")
            lay.tree.rename(old)
        work.rename(lay.tree)
        if old is not None:
            scratch.remove_tree(old)
    progress(
        f"ok: {len(patches)} patch(es) applied, series {sid}, HEAD {state['head'][:12]} "
        f"({time.monotonic() - t0:.1f}s)"
    )
    return "rebuilt"
