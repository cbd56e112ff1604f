"""The pin: ``patches/pin.json`` (version, git tag + commit, wheel sha256s, tree hash).

Also the content hashes that verify it. Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from harness import HarnessError
from harness.patchset.layout import Layout

BASE_TAG_PREFIX = "base/v"


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


def patched_version(pin: dict[str, Any], sid: str) -> str:
    return f"{pin['version']}+auxcap.{sid}"



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
