"""pr-export: PR bundles on synthetic releases over a local index (offline)."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from harness.patchset.layout import layout
from harness.upstream.prexport import pr_export, strip_trailers, template_for

from .fixtures import PIN, run_git, served_root


@pytest.fixture
def fixture_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with served_root(tmp_path, monkeypatch) as (root, wheels):
        yield root, wheels


def test_strip_trailers_keeps_foreign_trailers():
    body = "Why.\n\nPatch-Id: x\nDrop-In: none\nSigned-off-by: A <a@b>"
    assert strip_trailers(body) == "Why.\n\nSigned-off-by: A <a@b>"
    assert strip_trailers("Why.\n\nPatch-Id: x\nForwarded: yes") == "Why."


def test_templates_are_upstream_style():
    for pid in ("dsv2-capture-final-layer", "aux-packer"):
        path, src = template_for(pid)
        assert path.startswith("test/registered/") and Path(path).name.startswith("test_")
        assert "register_cpu_ci(" in src or "register_cuda_ci(" in src
        assert "unittest.main()" in src and 'if __name__ == "__main__":' in src
        assert "upstream-path" not in src
        compile(src, path, "exec")


def test_bundle_for_patch_not_landed(fixture_root):
    root, wheels = fixture_root
    results = root / "build" / "results"
    (results / "bench").mkdir(parents=True)
    (results / "ablation.json").write_text(json.dumps(
        {"patches": {"dsv2-capture-final-layer": {"without_patch": "fail", "with_patch": "pass"}}}))
    (results / "bench" / "memory.md").write_text("| path | peak |\n| --- | --- |\n| packer | 1 MiB |\n")
    written = pr_export(layout(root), remote="fork")
    assert [p.name for p in written] == ["dsv2-capture-final-layer"]
    d = root / "build" / "pr" / "dsv2-capture-final-layer"
    meta = json.loads((d / "bundle.json").read_text())
    # conflicts on 0.5.17 (upstream's packer differs), applies on 0.5.15: newest it applies to
    assert meta["base_release"] == "0.5.15"
    assert meta["deps"] == ["aux-packer"]  # not in 0.5.15, so its patch goes first
    assert (d / "title.txt").read_text().strip() == "Capture the final layer's aux hidden state"
    desc = (d / "description.md").read_text()
    assert "## Motivation" in desc and "without_patch" in desc and "packer | 1 MiB" in desc
    assert "test/registered/spec/test_deepseek_v2_capture_final_layer.py" in desc
    push = (d / "PUSH.md").read_text()
    assert "git push fork HEAD:refs/heads/auxcap/dsv2-capture-final-layer" in push
    assert "git checkout -b auxcap/dsv2-capture-final-layer v0.5.15" in push
    patch = (d / meta["patches"][0]).read_text()
    assert "Patch-Id:" not in patch and "Drop-In:" not in patch
    assert "b/test/registered/spec/test_deepseek_v2_capture_final_layer.py" in patch
    assert "b/python/sglang/srt/models/deepseek_v2.py" in patch
    # the bundle applies with git am on the release tree (deps first)
    work = root / "am"
    with zipfile.ZipFile(wheels["0.5.15"]) as zf:
        for m in zf.namelist():
            if m.startswith("sglang/"):
                t = work / "python" / m
                t.parent.mkdir(parents=True, exist_ok=True)
                t.write_bytes(zf.read(m))
    run_git(work, "init", "-q")
    run_git(work, "add", "-A")
    run_git(work, "commit", "-q", "-m", "v0.5.15")
    deps = sorted((d / "deps").glob("*.patch"))
    run_git(work, "am", "--no-3way", *map(str, deps), *[str(d / n) for n in meta["patches"]])
    assert "self.end_layer in self.layers_to_capture" in (
        work / "python/sglang/srt/models/deepseek_v2.py").read_text()


def test_without_results_evidence_says_not_run(fixture_root):
    root, _ = fixture_root
    pr_export(layout(root), versions=["0.5.14"])
    d = root / "build" / "pr"
    # newest scanned = 0.5.14: the packer is not landed there, so it gets a bundle too
    assert sorted(p.name for p in d.iterdir()) == ["aux-packer", "dsv2-capture-final-layer"]
    desc = (d / "aux-packer" / "description.md").read_text()
    assert "Ablation (each regression test fails without the patch): not run." in desc
    assert "Memory benchmark (list+cat vs packer peak bytes): not run." in desc
    assert json.loads((d / "aux-packer" / "bundle.json").read_text())["deps"] == []


def test_not_forwarded_is_skipped(fixture_root):
    root, _ = fixture_root
    p = next((root / "patches").glob("0004-*.patch"))
    p.write_text(p.read_text().replace("Forwarded: yes", "Forwarded: no"))
    assert pr_export(layout(root)) == []


def test_falls_back_to_pin_when_no_release_takes_it(fixture_root):
    root, _ = fixture_root
    written = pr_export(layout(root), versions=["0.5.17"])
    meta = json.loads((written[0] / "bundle.json").read_text())
    assert meta["base_release"] == PIN
    assert meta["notes"] and "Port it by hand" in meta["notes"][0]
    assert meta["deps"] == ["comm-readonly-residual", "dsv2-capture-after-allreduce", "aux-packer"]


def test_cli_verb(fixture_root):
    root, _ = fixture_root
    proc = subprocess.run(
        ["python3", "-m", "harness", "pr-export", "--versions", "0.5.15", "--only", "aux-packer"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (root / "build" / "pr" / "aux-packer" / "PUSH.md").exists()
