"""PyPI plumbing: the PEP 691 JSON index and hash-verified downloads into the cache.

Used by the pin (``apply-patches`` fetches the pinned wheel) and by upstream tracking
(release wheels). A cached file that fails its sha256 is moved aside to
``<cache>/quarantine/`` and downloaded again, as pip and uv do; one line says so.
Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

from harness import HarnessError, progress

DEFAULT_INDEX = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json"
QUARANTINE = "quarantine"

class Unreachable(HarnessError):
    """The index or a file on it could not be read (no network, DNS, HTTP error)."""

    def __init__(self, what: str, reason: object) -> None:
        super().__init__(f"cannot read {what} ({reason})")
        self.reason = reason


def index_url() -> str:
    return os.environ.get("HARNESS_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def net_timeout() -> float:
    return float(os.environ.get("HARNESS_NET_TIMEOUT", "20"))


def _reason(exc: BaseException) -> object:
    return getattr(exc, "reason", exc)


# ---------------------------------------------------------------- versions (PEP 440 subset)

_VER_RE = re.compile(
    r"^v?(?P<rel>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>alpha|beta|a|b|rc|c)[-_.]?(?P<pren>\d*))?"
    r"(?P<post>(?:-(?P<postn1>\d+))|(?:[-_.]?(?:post|rev|r)[-_.]?(?P<postn2>\d*)))?"
    r"(?P<dev>[-_.]?dev[-_.]?(?P<devn>\d*))?"
    r"(?:\+(?P<local>[a-z0-9.]+))?$",
    re.I,
)


def version_key(v: str) -> tuple:
    """Sort key for PEP 440 versions (release, pre, post, dev; local ignored)."""
    m = _VER_RE.match(v.strip())
    if not m:
        raise HarnessError(f"unparsable version {v!r}")
    rel = tuple(int(x) for x in m.group("rel").split("."))
    rel = rel + (0,) * max(0, 6 - len(rel))
    pre = (m.group("pre") or "").lower()
    if pre:
        pre_key = ({"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2}[pre], int(m.group("pren") or 0))
    elif m.group("dev") and not m.group("post"):
        pre_key = (-1, 0)
    else:
        pre_key = (3, 0)
    post_key = int(m.group("postn1") or m.group("postn2") or 0) if m.group("post") else -1
    dev_key = int(m.group("devn") or 0) if m.group("dev") else 1 << 30
    return (rel, pre_key, post_key, dev_key)


def is_final(v: str) -> bool:
    """A final or post release (no a/b/rc/dev)."""
    m = _VER_RE.match(v)
    return bool(m) and not m.group("pre") and not m.group("dev")


# ---------------------------------------------------------------- the index


def fetch_index(cache: Path, package: str = "sglang", offline_ok: bool = True) -> dict[str, Any]:
    """The PEP 691 JSON project page; cached (``<cache>/index-<pkg>.json``) for offline use."""
    url = f"{index_url()}/{package}/"
    cached = cache / f"index-{package}.json"
    try:
        req = urllib.request.Request(url, headers={"Accept": ACCEPT})
        with urllib.request.urlopen(req, timeout=net_timeout()) as resp:
            data = json.load(resp)
        data["_url"] = url
        cache.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(data))
        return data
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if offline_ok and cached.exists():
            progress(f"  index {url} unreachable ({_reason(exc)}); using cached {cached}")
            data = json.loads(cached.read_text())
            data.setdefault("_url", url)
            return data
        raise Unreachable(f"index {url}", _reason(exc)) from None


def _file_version(filename: str, package: str) -> str | None:
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return parts[1] if len(parts) >= 5 else None
    m = re.match(rf"^{re.escape(package)}-(.+)\.(tar\.gz|zip)$", filename, re.I)
    return m.group(1) if m else None


def release_files(index: dict[str, Any], package: str = "sglang") -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in index.get("files", []):
        v = _file_version(f.get("filename", ""), package)
        if v is not None:
            out.setdefault(v, []).append(f)
    for v in index.get("versions", []):
        out.setdefault(v, [])
    return out


def releases_after(index: dict[str, Any], pin_version: str, package: str = "sglang") -> list[str]:
    """Final/post releases newer than the pin that have a non-yanked wheel, oldest first."""
    files = release_files(index, package)
    pk = version_key(pin_version)
    out = [
        v for v, fs in files.items()
        if is_final(v) and version_key(v) > pk
        and any(f["filename"].endswith(".whl") and not f.get("yanked") for f in fs)
    ]
    return sorted(out, key=version_key)


def pick_wheel(index: dict[str, Any], version: str, package: str = "sglang") -> dict[str, Any]:
    """Prefer cp311 manylinux x86_64, then any x86_64, then any wheel. Python files are the
    same across a release's wheels."""
    fs = [
        f for f in release_files(index, package).get(version, [])
        if f["filename"].endswith(".whl") and not f.get("yanked")
    ]
    if not fs:
        raise HarnessError(f"{package} {version}: no wheel on {index.get('_url', index_url())}")

    def rank(f: dict[str, Any]) -> tuple:
        n = f["filename"]
        return ("-cp311-" not in n, "manylinux" not in n or "x86_64" not in n, "x86_64" not in n, n)

    best = sorted(fs, key=rank)[0]
    if not best.get("hashes", {}).get("sha256"):
        raise HarnessError(f"{best['filename']}: the index gives no sha256")
    return best


def file_url(index: dict[str, Any], entry: dict[str, Any]) -> str:
    return urllib.parse.urljoin(index.get("_url", index_url() + "/"), entry["url"])


# ---------------------------------------------------------------- verified files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def quarantine(path: Path, actual: str) -> Path:
    """Move a file that failed verification to ``<dir>/quarantine/<name>.<sha12>``."""
    qdir = path.parent / QUARANTINE
    qdir.mkdir(parents=True, exist_ok=True)
    dest = qdir / f"{path.name}.{actual[:12]}"
    path.replace(dest)
    return dest


def verified_file(cache: Path, name: str, sha256: str, url: Callable[[], str]) -> Path:
    """``<cache>/<name>`` with the given sha256, downloading it when needed.

    ``url`` is called only when a download is needed (it may read the index). A cached
    copy that fails the hash is moved to ``<cache>/quarantine/`` (one line says so) and
    fetched again. When that cannot replace it (offline, or the index serves the same
    bytes, i.e. the expected hash is what is wrong), the cached copy is put back and the
    error says why: nothing changes. A download that fails the hash is quarantined.
    """
    dest = cache / name
    moved: Path | None = None
    cached_sha = ""
    if dest.exists():
        cached_sha = sha256_file(dest)
        if cached_sha == sha256:
            return dest
        moved = quarantine(dest, cached_sha)
        progress(f"  cached {name} failed its sha256 (got {cached_sha[:12]}, want {sha256[:12]}); "
                 f"moved to {moved}, downloading again")
    cache.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(name + ".part")
    try:
        actual = _download(url(), part, name)
    except (urllib.error.URLError, OSError, ValueError, Unreachable) as exc:
        part.unlink(missing_ok=True)
        reason = exc.reason if isinstance(exc, Unreachable) else _reason(exc)
        if moved is not None:
            moved.replace(dest)
            raise HarnessError(
                f"{dest}: sha256 mismatch: expected {sha256}, got {cached_sha}, and no new copy: "
                f"cannot download {name} from {index_url()} ({reason})"
            ) from None
        raise HarnessError(
            f"cannot download {name} from {index_url()} ({reason}); not in cache {dest}"
        ) from None
    if actual != sha256:
        if moved is not None and actual == cached_sha:
            part.unlink()
            moved.replace(dest)
            raise HarnessError(
                f"{name}: sha256 mismatch: expected {sha256}, but the cache and {index_url()} "
                f"both have {actual} (is the expected hash wrong?)"
            )
        rejected = quarantine(part, actual)
        raise HarnessError(
            f"{name}: sha256 mismatch: expected {sha256}, got {actual} (download kept as {rejected})"
        )
    part.replace(dest)
    return dest


def _download(url: str, part: Path, name: str) -> str:
    """Stream ``url`` into ``part`` with progress lines; return the sha256 of the bytes."""
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=net_timeout()) as resp, open(part, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        done = 0
        last = 0.0
        tty = sys.stdout.isatty()
        while chunk := resp.read(1 << 16):
            out.write(chunk)
            h.update(chunk)
            done += len(chunk)
            now = time.monotonic()
            if now - last > (0.2 if tty else 2.0) or done == total:
                last = now
                line = f"  downloading {name}: {done}/{total or '?'} bytes"
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
        if tty:
            print(flush=True)
    return h.hexdigest()


def release_wheel(cache: Path, index: dict[str, Any], entry: dict[str, Any]) -> Path:
    """One release wheel from the index, verified against the index's sha256."""
    return verified_file(cache, entry["filename"], entry["hashes"]["sha256"], lambda: file_url(index, entry))
