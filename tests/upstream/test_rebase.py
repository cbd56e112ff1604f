"""rebase --to X (a new base, ported) and --promote X, on synthetic releases (offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import HarnessError
from harness.patchset.layout import layout
from harness.patchset.pin import load_pin
from harness.patchset.series import read_series
from harness.upstream.probes import PROBES, DirTree
from harness.upstream.rebase import promote, rebase

from .fixtures import FIXTURE_PROBES, run_git, served_root


@pytest.fixture
def fixture_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with served_root(tmp_path, monkeypatch) as (root, _wheels):
        yield root


def test_dry_run_changes_nothing(fixture_root):
    root = fixture_root
    before = {p.name: p.read_bytes() for p in (root / "patches").iterdir()}
    res = rebase(layout(root), "0.5.17", dry_run=True)
    assert res["status"] == "dry-run conflict"
    assert [d["id"] for d in res["dropped"]] == [
        "comm-readonly-residual", "dsv2-capture-after-allreduce", "aux-packer"]
    assert {p.name: p.read_bytes() for p in (root / "patches").iterdir()} == before
    assert not (root / "build" / "sglang").exists()


def test_rebase_clean(fixture_root):
    root = fixture_root
    lay = layout(root)
    pin_before = lay.pin_file.read_bytes()
    res = rebase(lay, "0.5.15")
    assert res["status"] == "ok"
    # a new base: the pin and its series are untouched
    assert lay.pin_file.read_bytes() == pin_before
    new = layout(root, base="0.5.15")
    pin = load_pin(new)
    assert pin["version"] == "0.5.15" and pin["git"]["tag"] == "v0.5.15"
    assert pin["git"]["commit"] is None and pin["git"]["commit_status"].startswith("unverified")
    assert len(pin["source_tree_sha256"]) == 64 and pin["wheels"]
    names = read_series(new)
    assert len(names) == 2 and names[0].startswith("0001-") and "aux" in names[0].lower()
    assert sorted(p.name for p in new.patches.glob("*.patch")) == sorted(names)
    tree = root / "build" / "sglang-0.5.15"
    assert new.tree == tree
    assert run_git(tree, "tag").split() == ["base/v0.5.15"]
    assert len(run_git(tree, "log", "--format=%s", "base/v0.5.15..patched").splitlines()) == 2
    # re-exported patches now carry the new line numbers: zero offset on the new base
    from harness.patchset.apply import apply_patches

    assert apply_patches(new) == "up to date"
    found = {pid: PROBES[pid](DirTree(tree / "python")).found for pid in FIXTURE_PROBES}
    assert all(found.values())
    with pytest.raises(HarnessError, match="exists already"):
        rebase(lay, "0.5.15")


def test_promote_needs_green_tests_then_moves_the_base(fixture_root):
    root = fixture_root
    lay = layout(root)
    rebase(lay, "0.5.15")
    new = layout(root, base="0.5.15")
    with pytest.raises(HarnessError, match="no test results"):
        promote(lay, "0.5.15")
    new.results.mkdir(parents=True)
    junit = new.results / "junit.xml"
    junit.write_text('<testsuites><testsuite name="pytest" errors="0" failures="1" tests="3"/></testsuites>')
    with pytest.raises(HarnessError, match="1 failure"):
        promote(lay, "0.5.15")
    junit.write_text('<testsuites><testsuite name="pytest" errors="0" failures="0" tests="3"/></testsuites>')
    names = read_series(new)
    promote(lay, "0.5.15")
    assert load_pin(layout(root))["version"] == "0.5.15"
    assert read_series(layout(root)) == names
    assert not (root / "patches" / "0.5.15").exists()
    assert run_git(root / "build" / "sglang", "tag").split() == ["base/v0.5.15"]
    assert (root / "build" / "results" / "junit.xml").exists()
    from harness.patchset.apply import apply_patches

    assert apply_patches(layout(root)) == "up to date"


def test_rebase_conflict_leaves_am_session(fixture_root, capsys):
    root = fixture_root
    lay = layout(root)
    res = rebase(lay, "0.5.17")
    assert res["status"] == "conflict"
    c = res["conflict"]
    assert c["id"] == "dsv2-capture-final-layer"
    assert c["problems"][0].startswith("python/sglang/srt/models/deepseek_v2.py: hunk #1")
    out = capsys.readouterr().out
    assert "git am --continue" in out and "make export-patches BASE=0.5.17" in out
    tree = root / "build" / "sglang-0.5.17"
    assert (tree / ".git" / "rebase-apply").is_dir()
    assert list(tree.rglob("*.rej"))
    assert load_pin(lay)["version"] == "0.5.13.post1"
    lay = layout(root, base="0.5.17")
    assert load_pin(lay)["version"] == "0.5.17" and len(read_series(lay)) == 1
    # export refuses while the session is open
    from harness.patchset.export import export_patches

    with pytest.raises(HarnessError, match="in progress"):
        export_patches(lay)
    # resolve by hand, continue, export
    for rej in tree.rglob("*.rej"):
        rej.unlink()
    f = tree / "python/sglang/srt/models/deepseek_v2.py"
    f.write_text(f.read_text().replace(
        "        hidden_states, _ = self.norm(hidden_states, residual)\n",
        "        if self.end_layer in self.layers_to_capture:\n"
        "            aux_hidden_states.append(hidden_states + residual)\n"
        "        hidden_states, _ = self.norm(hidden_states, residual)\n"))
    run_git(tree, "add", "-A")
    run_git(tree, "am", "--continue")
    export_patches(lay)
    names = read_series(lay)
    assert len(names) == 1
    assert "Patch-Id: dsv2-capture-final-layer" in (lay.patches / names[0]).read_text()
    assert PROBES["dsv2-capture-final-layer"](DirTree(tree / "python")).found is True


def test_refuses_same_version_and_unexported_work_on_the_new_base(fixture_root):
    root = fixture_root
    lay = layout(root)
    with pytest.raises(HarnessError, match="already"):
        rebase(lay, "0.5.13.post1")
    res = rebase(lay, "0.5.14")
    assert res["status"] == "ok"
    # work in progress on base 0.5.14's tree, its patches/ folder gone: still refused
    new = layout(root, base="0.5.14")
    (new.tree / "python" / "x.py").write_text("x = 1\n")
    import shutil

    shutil.rmtree(new.patches)
    with pytest.raises(HarnessError, match="uncommitted"):
        rebase(lay, "0.5.14")


@pytest.mark.parametrize("extra, partial", [
    ([], False), (["-x", "-q"], False), (["-k", "llama"], True), (["-kllama"], True),
    (["-m", "slow"], True), (["--deselect=tests/x.py::t"], True), (["--lf"], True),
])
def test_only_a_whole_suite_run_writes_the_junit_promote_trusts(extra, partial):
    from harness.suites.test import selects

    assert selects(extra) is partial
