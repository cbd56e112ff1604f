"""Shared plumbing for the patch-tooling verbs (stdlib only).

Paths are injectable: every function takes a :class:`Layout`, built by :func:`layout`
from an explicit root, ``$HARNESS_ROOT``, or the repository this package lives in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import ROOT, HarnessError

STATE_FILE = "auxcap-state.json"  # inside build/sglang/.git/
BASE_TAG_PREFIX = "base/v"
BRANCH = "patched"
# Identity used for the pristine pin commit and as committer of every patch commit.
BASE_IDENT = ("SGLang release", "release@sglang.invalid")
HARNESS_IDENT = ("auxcap harness", "harness@auxcap.invalid")


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def pin_file(self) -> Path:
        return self.patches / "pin.json"

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def tree(self) -> Path:
        return self.build / "sglang"

    @property
    def dist(self) -> Path:
        return self.build / "dist"

    @property
    def cache(self) -> Path:
        return Path(os.environ.get("HARNESS_CACHE", self.root / ".cache" / "pypi"))

    @property
    def state_file(self) -> Path:
        return self.tree / ".git" / STATE_FILE

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


def layout(root: str | Path | None = None) -> Layout:
    if root is None:
        root = os.environ.get("HARNESS_ROOT") or ROOT
    return Layout(Path(root).resolve())


# ---------------------------------------------------------------- pin and series


def load_pin(lay: Layout) -> dict[str, Any]:
    try:
        return json.loads(lay.pin_file.read_text())
    except FileNotFoundError:
        raise HarnessError(f"{lay.rel(lay.pin_file)}: missing") from None
    except json.JSONDecodeError as exc:
        raise HarnessError(f"{lay.rel(lay.pin_file)}: invalid JSON: {exc}") from None


def write_pin(lay: Layout, pin: dict[str, Any]) -> None:
    lay.pin_file.write_text(json.dumps(pin, indent=2) + "\n")


def pin_wheel(pin: dict[str, Any], pytag: str = "cp311") -> tuple[str, str]:
    """(filename, sha256) of the pinned x86_64 wheel for ``pytag``."""
    for name, info in sorted(pin.get("wheels", {}).items()):
        if f"-{pytag}-{pytag}-" in name and name.endswith("x86_64.whl"):
            return name, info["sha256"]
    raise HarnessError(f"pin.json lists no {pytag} x86_64 wheel")


def base_tag(pin: dict[str, Any]) -> str:
    return BASE_TAG_PREFIX + pin["version"]


def parse_series(text: str) -> tuple[list[str], list[str]]:
    """(header lines, patch names). Header = leading comment/blank lines."""
    header: list[str] = []
    names: list[str] = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.append(entry)
        elif not names:
            header.append(line)
    return header, names


def read_series(lay: Layout) -> list[str]:
    if not lay.series_file.exists():
        return []
    return parse_series(lay.series_file.read_text())[1]


def series_id(lay: Layout | None = None) -> str:
    """sha256 over pin.json + series + each listed patch's bytes; first 10 hex digits."""
    lay = lay or layout()
    h = hashlib.sha256()
    h.update(lay.pin_file.read_bytes())
    h.update(lay.series_file.read_bytes() if lay.series_file.exists() else b"")
    for name in read_series(lay):
        path = lay.patches / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.exists() else b"<missing>")
    return h.hexdigest()[:10]


def patched_version(pin: dict[str, Any], sid: str) -> str:
    return f"{pin['version']}+auxcap.{sid}"


# ---------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_hash(entries: dict[str, str]) -> str:
    """Content hash of a tree: ``{relpath: sha256}`` -> sha256 of sorted lines."""
    h = hashlib.sha256()
    for rel in sorted(entries):
        h.update(f"{rel}\0{entries[rel]}\n".encode())
    return h.hexdigest()


def hash_dir(top: Path, under: str = "python/sglang") -> str:
    entries = {}
    base = top / under
    for path in sorted(base.rglob("*")):
        if path.is_file() and not path.name.endswith(".so"):
            rel = path.relative_to(top).as_posix()
            entries[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return tree_hash(entries)


# ---------------------------------------------------------------- git


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
    "am.keepcr=false",
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


def progress(msg: str) -> None:
    print(msg, flush=True)


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- patch files

_TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s*(.*)$")


def patch_message(text: str) -> tuple[str, str, dict[str, str]]:
    """(subject, body, trailers) of a ``git format-patch`` mail."""
    head, _, rest = text.partition("\n\n")
    subject = ""
    lines = head.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject:"):
            subject = line[len("Subject:") :].strip()
            for cont in lines[i + 1 :]:
                if cont.startswith((" ", "\t")):
                    subject += " " + cont.strip()
                else:
                    break
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    body = re.split(r"^(?:---$|diff --git )", rest, maxsplit=1, flags=re.M)[0]
    paragraphs = [p for p in body.strip().split("\n\n") if p.strip()]
    trailers: dict[str, str] = {}
    if paragraphs:
        last = paragraphs[-1].splitlines()
        parsed = [_TRAILER_RE.match(x) for x in last]
        if all(parsed):
            for m in parsed:
                assert m is not None
                trailers.setdefault(m.group(1), m.group(2).strip())
    return subject, body, trailers


def patch_files(text: str) -> list[str]:
    """Paths (post-image, or pre-image for deletions) a patch touches."""
    out: list[str] = []
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", text, re.M):
        if m.group(2) not in out:
            out.append(m.group(2))
    return out


def hunk_for_line(text: str, path: str, line: int) -> str:
    """Describe the hunk of ``path`` in a patch whose old start is ``line``."""
    current = None
    n = 0
    best = None
    for raw in text.splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", raw)
        if m:
            current = m.group(1)
            n = 0
            continue
        if current == path and raw.startswith("@@"):
            n += 1
            hm = re.match(r"^@@ -(\d+)", raw)
            if hm and int(hm.group(1)) == line:
                return f"hunk #{n} ({raw.strip()})"
            if best is None:
                best = f"hunk #{n} ({raw.strip()})"
    return f"hunk at line {line}" if best is None else f"hunk at line {line}"
