"""pr-export drift: do bundles still apply to releases after their base? (offline: a fake
index dict, wheels already in the cache, urlopen refused where the index is unreachable)."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import harness.upstream.drift as drift
from harness.patchset.layout import layout
from harness.upstream.probes import PROBES, ProbeResult

from .fixtures import make_wheel, run_git, wheel_name

BASE = "9.9"
URL = "http://index.invalid/simple/sglang/"
ANSWER = "sglang/answer.py"
HEAD = '"""The answer."""\n\nimport os\n\n\n'
TAIL = "\n\ndef other():\n    return os.sep\n"
BUGGY = HEAD + "def answer():\n    return 41\n" + TAIL
FIXED = HEAD + "def answer():\n    return 42\n" + TAIL
PID = "fix-answer"
# release -> sglang/answer.py in it
RELEASES = {
    "9.8": BUGGY,
    BASE: BUGGY,
    "9.10": "# upstream churn\n\n" + BUGGY,  # applies (at an offset)
    "9.11": HEAD + "def answer():\n    return int('41')\n" + TAIL,  # conflicts
    "9.12": FIXED,  # landed
}


def _patch(tmp: Path) -> str:
    """The bundle's patch: the fix plus a new upstream test, as git format-patch output."""
    repo = tmp / "src"
    (repo / "python" / "sglang").mkdir(parents=True)
    (repo / "python" / ANSWER).write_text(BUGGY)
    run_git(repo, "init", "-q")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "base")
    (repo / "python" / ANSWER).write_text(FIXED)
    (repo / "test" / "registered").mkdir(parents=True)
    (repo / "test" / "registered" / "test_answer.py").write_text("assert True\n")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "Fix the answer")
    return run_git(repo, "format-patch", "-1", "--stdout", "--zero-commit")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root (pin.json, one bundle in build/pr/) with every release's wheel in the cache."""
    root = tmp_path / "root"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "pin.json").write_text(json.dumps({"package": "sglang", "version": BASE}))
    dest = root / "build" / "pr" / PID
    dest.mkdir(parents=True)
    (dest / "0001-Fix-the-answer.patch").write_text(_patch(tmp_path))
    (dest / "bundle.json").write_text(json.dumps({
        "id": PID, "base_release": BASE, "patches": ["0001-Fix-the-answer.patch"], "deps": []}))
    for v, text in RELEASES.items():
        make_wheel(root / ".cache" / "pypi" / wheel_name(v), v, {"sglang/__init__.py": "", ANSWER: text})
    monkeypatch.setenv("HARNESS_ROOT", str(root))
    monkeypatch.delenv("HARNESS_CACHE", raising=False)
    return root


def fake_index(root: Path, versions: list[str]):
    """A ``fetch_index`` stand-in serving ``versions`` (their wheels are in the cache)."""
    def files(v: str) -> dict:
        w = root / ".cache" / "pypi" / wheel_name(v)
        return {"filename": w.name, "url": f"../../files/{w.name}",
                "hashes": {"sha256": hashlib.sha256(w.read_bytes()).hexdigest()}}

    def fetch(cache: Path, package: str = "sglang", offline_ok: bool = True) -> dict:
        return {"_url": URL, "versions": versions, "files": [files(v) for v in versions]}

    return fetch


def run(root: Path, monkeypatch, versions: list[str], probes=None) -> tuple[dict, dict]:
    monkeypatch.setattr(drift, "fetch_index", fake_index(root, versions))
    result = drift.report_drift(layout(root), [root / "build" / "pr" / PID], probes or {})
    meta = json.loads((root / "build" / "pr" / PID / "bundle.json").read_text())
    return result, meta


def test_no_newer_release_is_current(root, monkeypatch, capsys):
    result, meta = run(root, monkeypatch, ["9.8", BASE])
    assert capsys.readouterr().out.splitlines() == [
        f"drift: no sglang release after {BASE} on {URL}; bundles are current"]
    assert meta["drift"] == result[PID] == {
        "status": "current", "index": URL, "base_release": BASE, "releases": {}}
    assert meta["base_release"] == BASE  # the rest of bundle.json is kept


def test_newer_release_where_the_bundle_applies(root, monkeypatch, capsys):
    _, meta = run(root, monkeypatch, [BASE, "9.10"])
    out = capsys.readouterr().out.splitlines()
    assert out == [f"drift: sglang release(s) after {BASE} on {URL}: 9.10",
                   f"drift:   {PID} on 9.10: applies"]
    cell = meta["drift"]["releases"]["9.10"]
    assert meta["drift"]["status"] == "behind"
    assert cell["status"] == "applies" and cell["apply"]["ok"] and cell["landed"] is None
    assert cell["apply"]["offsets"]  # upstream churn above the hunk: an offset, no fuzz


def test_newer_release_where_the_bundle_conflicts_names_the_file(root, monkeypatch, capsys):
    _, meta = run(root, monkeypatch, [BASE, "9.10", "9.11"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "on 9.11" in x)
    assert line.startswith(f"drift:   {PID} on 9.11: conflicts in python/{ANSWER}: "
                           f"python/{ANSWER}: hunk #1 @@")
    cell = meta["drift"]["releases"]["9.11"]
    assert cell["status"] == "conflicts" and cell["apply"]["files"] == [f"python/{ANSWER}"]
    assert meta["drift"]["releases"]["9.10"]["status"] == "applies"


def test_landed_where_the_probe_finds_the_patch(root, monkeypatch, capsys):
    monkeypatch.setitem(PROBES, PID, lambda tree: ProbeResult(PID, "42" in (tree.read(ANSWER) or ""), []))
    _, meta = run(root, monkeypatch, [BASE, "9.10", "9.12"], probes={PID: [PID]})
    cells = meta["drift"]["releases"]
    assert cells["9.10"]["status"] == "applies" and cells["9.10"]["landed"] is False
    assert cells["9.12"]["status"] == "landed" and cells["9.12"]["landed"] is True
    assert f"drift:   {PID} on 9.12: landed (Upstream-Probe {PID} finds it); git apply: conflicts" \
        in capsys.readouterr().out


def test_deps_go_first_and_name_themselves(root, monkeypatch, capsys):
    dest = root / "build" / "pr" / PID
    (dest / "deps").mkdir()
    (dest / "deps" / "0001-dep.patch").write_text((dest / "0001-Fix-the-answer.patch").read_text())
    _, meta = run(root, monkeypatch, [BASE, "9.10", "9.11"])
    cells = meta["drift"]["releases"]
    # 9.10: the dep applies and takes the fix, so the bundle's own patch (the same change)
    # no longer does; 9.11: the dep itself conflicts, and its problems say so
    assert cells["9.10"]["status"] == cells["9.11"]["status"] == "conflicts"
    assert cells["9.10"]["apply"]["problems"]
    assert not any(p.startswith("deps/") for p in cells["9.10"]["apply"]["problems"])
    assert cells["9.11"]["apply"]["problems"][0].startswith(
        f"deps/0001-dep.patch: python/{ANSWER}: hunk #1 @@")


def test_unreachable_index_is_one_line_and_no_error(root, monkeypatch, capsys):
    def refuse(*a, **kw):
        raise urllib.error.URLError("connection refused")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setenv("HARNESS_INDEX_URL", "http://127.0.0.1:9/simple")
    assert not (root / ".cache" / "pypi" / "index-sglang.json").exists()
    result = drift.report_drift(layout(root), [root / "build" / "pr" / PID], {})
    out = capsys.readouterr().out.splitlines()
    assert out == ["drift: not checked: cannot read index http://127.0.0.1:9/simple/sglang/ "
                   "(connection refused)"]
    meta = json.loads((root / "build" / "pr" / PID / "bundle.json").read_text())
    assert meta["drift"]["status"] == result[PID]["status"] == "not checked"


def test_unreadable_bundle_is_not_checked(root, capsys):
    (root / "build" / "pr" / PID / "bundle.json").write_text("{}")
    assert drift.report_drift(layout(root), [root / "build" / "pr" / PID], {}) == {}
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("drift: not checked: ") and "no id, base_release, patches" in line


def test_export_from_base_reports_drift(tmp_path, monkeypatch, capsys):
    """The call site: pr-export from a base prints the drift and records it."""
    from harness.upstream.prexport import export_from_base

    from .test_prexport import BASE as PR_BASE
    from .test_prexport import _base_root

    root = _base_root(tmp_path, monkeypatch)
    monkeypatch.setattr(drift, "fetch_index", lambda cache, package="sglang", offline_ok=True: {
        "_url": URL, "versions": [PR_BASE], "files": []})
    [d] = export_from_base(layout(root, base=PR_BASE))
    assert f"drift: no sglang release after {PR_BASE} on {URL}; bundles are current" \
        in capsys.readouterr().out
    assert json.loads((d / "bundle.json").read_text())["drift"]["status"] == "current"
