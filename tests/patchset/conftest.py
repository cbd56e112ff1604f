"""Offline fixtures: a fake pin (wheel + pin.json + patches) in a temp HARNESS_ROOT."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from harness.patchset.layout import layout
from harness.patchset.pin import write_pin
from harness.patchset.pypi import sha256_file

VERSION = "0.5.13.post1"
WHEEL = f"sglang-{VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
MOD = "sglang/srt/layers/mod.py"
MOD_TEXT = "".join(f"line_{i} = {i}\n" for i in range(1, 41))


def make_wheel(path: Path) -> None:
    files = {
        "sglang/__init__.py": "from sglang._version import __version__\n",
        "sglang/_version.py": (
            f"__version__ = version = '{VERSION}'\n"
            "__version_tuple__ = version_tuple = (0, 5, 13, 'post1')\n"
        ),
        MOD: MOD_TEXT,
        "sglang/srt/other.py": "x = 1\n",
        "sglang/srt/_core.cpython-311-x86_64-linux-gnu.so": "\x7fELF-not-really",
        "tools/helper.py": "pass\n",
        f"sglang-{VERSION}.dist-info/METADATA": f"Metadata-Version: 2.4\nName: sglang\nVersion: {VERSION}\n\n",
        f"sglang-{VERSION}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-manylinux_2_34_x86_64\n",
        f"sglang-{VERSION}.dist-info/top_level.txt": "sglang\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"sglang-{VERSION}.dist-info/RECORD,,\n"
    files[f"sglang-{VERSION}.dist-info/RECORD"] = record
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, (2026, 6, 15, 0, 0, 0))
            info.external_attr = 0o100644 << 16
            zf.writestr(info, text)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=Dev", "-c", "user.email=dev@example.invalid", *args],
        cwd=cwd, check=True, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "GIT_CONFIG_GLOBAL": "/dev/null",
             "GIT_AUTHOR_DATE": "2026-07-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-07-01T00:00:00+0000"},
    ).stdout


TRAILERS = "Patch-Id: {pid}\nOrigin: new\nForwarded: no\nUpstream-Status: not yet\nDrop-In: none\n"


def commit_change(tree: Path, rel: str, old: str, new: str, pid: str, subject: str) -> None:
    p = tree / rel
    p.write_text(p.read_text().replace(old, new))
    git(tree, "commit", "-q", "-am", f"{subject}\n\nWhy it matters.\n\n" + TRAILERS.format(pid=pid))


@pytest.fixture(scope="session")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with pin.json, a cached fake wheel and two exported patches."""
    from harness.patchset.apply import apply_patches
    from harness.patchset.export import export_patches

    root = tmp_path_factory.mktemp("template")
    (root / "patches").mkdir()
    cache = root / ".cache" / "pypi"
    cache.mkdir(parents=True)
    make_wheel(cache / WHEEL)
    pin = {
        "package": "sglang",
        "version": VERSION,
        "released": "2026-06-15",
        "git": {"url": "http://127.0.0.1:9/sglang.git", "tag": f"v{VERSION}", "commit": "0" * 40},
        "wheels": {WHEEL: {"sha256": sha256_file(cache / WHEEL)}},
        "source_tree_sha256": "TO-BE-COMPUTED",
    }
    lay = layout(root)
    write_pin(lay, pin)
    (root / "patches" / "series").write_text("# test series\n\n")
    apply_patches(lay, update_lock=True)
    tree = lay.tree
    commit_change(tree, "python/" + MOD, "line_10 = 10\n", "line_10 = 100\n", "first-fix", "Fix line ten")
    commit_change(tree, "python/" + MOD, "line_30 = 30\n", "line_30 = 300\n", "second-fix", "Fix line thirty")
    export_patches(lay)
    shutil.rmtree(root / "build")
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    dest = tmp_path / "repo"
    shutil.copytree(template, dest)
    monkeypatch.setenv("HARNESS_ROOT", str(dest))
    monkeypatch.setenv("HARNESS_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("HARNESS_NET_TIMEOUT", "3")
    monkeypatch.delenv("HARNESS_CACHE", raising=False)
    monkeypatch.delenv("SGLANG_SOURCE", raising=False)
    return dest


@pytest.fixture
def index(root: Path):
    """A local PEP 691 index serving the fixture wheel; yields (url, wheel bytes dict)."""
    wheel_bytes = {"data": (root / ".cache" / "pypi" / WHEEL).read_bytes()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # noqa: D401
            pass

        def do_GET(self):  # noqa: N802
            if self.path.rstrip("/").endswith("/simple/sglang"):
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": "sglang", "files": [
                    {"filename": WHEEL, "url": f"../../files/{WHEEL}",
                     "hashes": {"sha256": hashlib.sha256(wheel_bytes["data"]).hexdigest()},
                     "size": len(wheel_bytes["data"])}]}).encode()
            elif self.path.endswith(WHEEL):
                body = wheel_bytes["data"]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/simple", wheel_bytes
    finally:
        srv.shutdown()
