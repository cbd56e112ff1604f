"""A few small git verbs with a fixed, user-independent configuration.

Every call runs ``git -c <GIT_CONFIG...>`` with the user's and system config ignored, so
``am`` and ``format-patch`` give the same bytes on every machine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness import HarnessError

BRANCH = "patched"
# Identity used for the pristine pin commit and as committer of every patch commit.
BASE_IDENT = ("SGLang release", "release@sglang.invalid")
HARNESS_IDENT = ("auxcap harness", "harness@auxcap.invalid")


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
        LANG="C",
    )
    if extra:
        env.update(extra)
    return env


# Config that makes am/format-patch output independent of the user's git config.
GIT_CONFIG = [
    "core.autocrlf=false",
    "core.abbrev=12",
    "core.quotePath=true",
    "core.hooksPath=" + os.devnull,
    "gc.auto=0",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "diff.algorithm=myers",
    "diff.renames=true",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.context=3",
    "diff.interHunkContext=0",
    "diff.suppressBlankEmpty=false",
    "format.signature=",
    "format.coverLetter=false",
    "format.numbered=false",
    "format.filenameMaxLength=64",
    "am.threeWay=false",
    "am.keepcr=true",  # format-patch keeps the CRs of CRLF files; am must too
    "apply.whitespace=nowarn",
    f"user.name={HARNESS_IDENT[0]}",
    f"user.email={HARNESS_IDENT[1]}",
]


def git(
    cwd: Path,
    *args: str,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    cmd = ["git"]
    for c in GIT_CONFIG:
        cmd += ["-c", c]
    cmd += list(args)
    proc = subprocess.run(
        cmd, cwd=cwd, env=git_env(env), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        first = next((m for m in msg if m.startswith(("error:", "fatal:"))), msg[0] if msg else "")
        raise HarnessError(f"git {args[0]} failed in {cwd}: {first}")
    return proc


def export_commit(tree: Path, commit: str, paths: str, dest: Path) -> Path:
    """``paths`` of ``commit`` in ``tree`` as plain files under ``dest`` (``git archive``),
    exported once: ``dest/.commit`` records the commit, and a different one replaces the
    export. Returns ``dest``."""
    import shutil

    stamp = dest / ".commit"
    if stamp.exists() and stamp.read_text() == commit:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(tree), "archive", commit, paths],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    stamp.write_text(commit)
    return dest


def replay_tree(tree: Path, onto: str, commits: list[str], index_file: Path) -> tuple[str | None, str]:
    """The tree of ``onto`` with each of ``commits``' own changes applied on it in order,
    exactly as ``git am`` would take them (``git apply --cached``: no fuzz, no three-way
    merge), in a scratch index (``index_file``; the work tree and its index are not
    touched). Returns ``(tree id, "")``, or ``(None, why)`` naming the first commit that
    does not apply and git's first error line (the file it could not patch)."""
    env = {"GIT_INDEX_FILE": str(index_file)}
    try:
        git(tree, "read-tree", onto, env=env)
        for commit in commits:
            diff = git(tree, "diff-tree", "-p", "--binary", "--full-index", f"{commit}~1", commit).stdout
            cmd = ["git"]
            for c in GIT_CONFIG:
                cmd += ["-c", c]
            proc = subprocess.run(cmd + ["apply", "--cached", "-"], cwd=tree, env=git_env(env),
                                  input=diff, capture_output=True, text=True)
            if proc.returncode != 0:
                subject = git(tree, "log", "-1", "--format=%s", commit).stdout.strip()
                lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
                first = next((x for x in lines if x.startswith("error:")), lines[0] if lines else "")
                return None, f"{subject!r} does not apply without it ({first.removeprefix('error: ')})"
        return git(tree, "write-tree", env=env).stdout.strip(), ""
    finally:
        index_file.unlink(missing_ok=True)
