"""apply-patches: happy path, no-op, rebuild, every failure mode (offline fixtures)."""

from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ROOT, HarnessError
from harness.patchset.apply import apply_patches, read_state
from harness.patchset.layout import layout
from harness.patchset.pin import load_pin, write_pin

from .conftest import MOD, WHEEL, commit_change, git


def run_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    e = dict(os.environ, HARNESS_ROOT=str(root), **(env or {}))
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, env=e,
                          cwd=Path(__file__).resolve().parents[2])


def head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD").strip()


def test_apply_ok_then_noop(root: Path) -> None:
    lay = layout(root)
    assert apply_patches(lay) == "rebuilt"
    tree = lay.tree
    log = git(tree, "log", "--format=%s", "base/v0.5.13.post1..patched").splitlines()
    assert log == ["Fix line thirty", "Fix line ten"]
    assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "patched"
    assert "line_10 = 100" in (tree / "python" / MOD).read_text()
    assert not list(tree.rglob("*.so"))
    assert read_state(lay)["head"] == head(tree)
    t0 = time.monotonic()
    proc = run_cli(root, "apply-patches")
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout
    assert time.monotonic() - t0 < 5


def test_base_commit_is_deterministic(root: Path, tmp_path: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    first = head(lay.tree)
    apply_patches(lay, force=True)
    assert head(lay.tree) == first


def test_changed_series_rebuilds(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    series = lay.series_file
    series.write_text(series.read_text().replace("0002-Fix-line-thirty.patch\n", ""))
    (lay.patches / "0002-Fix-line-thirty.patch").unlink()
    assert apply_patches(lay) == "rebuilt"
    assert "line_30 = 30\n" in (lay.tree / "python" / MOD).read_text()


def _corrupt_second(lay) -> None:
    p = lay.patches / "0002-Fix-line-thirty.patch"
    p.write_text(p.read_text().replace("-line_30 = 30", "-line_30 = 31"))


def test_conflicting_patch_names_patch_file_hunk_and_keeps_tree(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    good = head(lay.tree)
    _corrupt_second(lay)
    with pytest.raises(HarnessError) as exc:
        apply_patches(lay)
    msg = str(exc.value)
    assert "0002-Fix-line-thirty.patch" in msg and "python/" + MOD in msg and "hunk #1" in msg
    assert "\n" not in msg
    assert head(lay.tree) == good  # previous good tree intact
    assert not (lay.tree / ".git" / "rebase-apply").exists()
    assert not [p for p in lay.build.iterdir() if p.name.startswith(".sglang-")]


def test_corrupt_patch_file(root: Path) -> None:
    lay = layout(root)
    p = lay.patches / "0001-Fix-line-ten.patch"
    p.write_text(p.read_text().replace("@@ -7,7 +7,7 @@", "@@ -7,7 +7,9 @@"))
    with pytest.raises(HarnessError) as exc:
        apply_patches(lay)
    assert "0001-Fix-line-ten.patch" in str(exc.value)
    assert not lay.tree.exists()
    assert not [p for p in lay.build.iterdir() if p.name.startswith(".sglang-")]


def test_offset_patch_rejected(root: Path) -> None:
    lay = layout(root)
    p = lay.patches / "0002-Fix-line-thirty.patch"
    # same content, but the hunk claims to start 2 lines early: applies only with an offset
    p.write_text(p.read_text().replace("@@ -27,7 +27,7 @@", "@@ -25,7 +25,7 @@"))
    with pytest.raises(HarnessError) as exc:
        apply_patches(lay)
    msg = str(exc.value)
    assert "0002-Fix-line-thirty.patch" in msg and "hunk #1" in msg and "offset" in msg


def test_dirty_tree_refused_then_force(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    (lay.tree / "python" / MOD).write_text("edited\n")
    proc = run_cli(root, "apply-patches")
    assert proc.returncode == 1
    assert "export-patches" in proc.stderr and "FORCE=1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert apply_patches(lay, force=True) == "rebuilt"
    assert "line_10 = 100" in (lay.tree / "python" / MOD).read_text()


def test_bytecode_in_the_tree_is_not_a_change(root: Path) -> None:
    """A python run outside tox writes __pycache__/ next to the sources; the tree stays
    up to date (a new, untracked .py file still makes it dirty)."""
    lay = layout(root)
    apply_patches(lay)
    cache = (lay.tree / "python" / MOD).parent / "__pycache__"
    cache.mkdir()
    (cache / "mod.cpython-311.pyc").write_bytes(b"\0")
    assert apply_patches(lay) == "up to date"
    (lay.tree / "python" / "stray.py").write_text("x = 1\n")
    with pytest.raises(HarnessError, match="uncommitted"):
        apply_patches(lay)


def test_unexported_commit_refused(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    commit_change(lay.tree, "python/" + MOD, "line_5 = 5\n", "line_5 = 50\n", "third", "Third")
    with pytest.raises(HarnessError, match="not exported"):
        apply_patches(lay)


def test_hash_mismatch_refused_and_file_kept(root: Path) -> None:
    lay = layout(root)
    pin = load_pin(lay)
    pin["wheels"][WHEEL]["sha256"] = "0" * 64
    write_pin(lay, pin)
    with pytest.raises(HarnessError) as exc:
        apply_patches(lay)
    msg = str(exc.value)
    assert WHEEL in msg and "0" * 64 in msg and "mismatch" in msg
    assert (lay.cache / WHEEL).exists()


def test_tree_hash_mismatch(root: Path) -> None:
    lay = layout(root)
    pin = load_pin(lay)
    pin["source_tree_sha256"] = "f" * 64
    write_pin(lay, pin)
    with pytest.raises(HarnessError, match="source tree hash mismatch"):
        apply_patches(lay)
    apply_patches(lay, update_lock=True)
    assert load_pin(lay)["source_tree_sha256"] != "f" * 64


def test_no_network_no_cache(root: Path) -> None:
    (root / ".cache" / "pypi" / WHEEL).unlink()
    proc = run_cli(root, "apply-patches")
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1
    assert WHEEL in err and str(root / ".cache" / "pypi") in err


def test_download_from_index(root: Path, index, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = index
    cached = root / ".cache" / "pypi" / WHEEL
    data = cached.read_bytes()
    cached.unlink()
    monkeypatch.setenv("HARNESS_INDEX_URL", url)
    proc = run_cli(root, "apply-patches", env={"HARNESS_INDEX_URL": url})
    assert proc.returncode == 0, proc.stderr
    assert "downloading" in proc.stdout and f"{len(data)}/{len(data)} bytes" in proc.stdout
    assert cached.read_bytes() == data


def test_download_hash_mismatch(root: Path, index) -> None:
    url, wheel = index
    (root / ".cache" / "pypi" / WHEEL).unlink()
    wheel["data"] = wheel["data"] + b"tampered"
    proc = run_cli(root, "apply-patches", env={"HARNESS_INDEX_URL": url})
    assert proc.returncode == 1
    assert "sha256 mismatch" in proc.stderr and WHEEL in proc.stderr
    assert not (root / ".cache" / "pypi" / WHEEL).exists()


def test_truncated_cache_is_quarantined_and_downloaded_again(root: Path, index) -> None:
    url, wheel = index
    cached = root / ".cache" / "pypi" / WHEEL
    good = cached.read_bytes()
    cached.write_bytes(good[: len(good) // 2])  # an interrupted copy, a full disk, ...
    proc = run_cli(root, "apply-patches", env={"HARNESS_INDEX_URL": url})
    assert proc.returncode == 0, proc.stderr
    said = [x for x in proc.stdout.splitlines() if "failed its sha256" in x]
    assert len(said) == 1 and WHEEL in said[0] and "quarantine" in said[0]
    assert cached.read_bytes() == good
    assert len(list((cached.parent / "quarantine").iterdir())) == 1


def test_bad_cache_offline_is_put_back_with_one_line(root: Path) -> None:
    cached = root / ".cache" / "pypi" / WHEEL
    cached.write_bytes(b"truncated")
    proc = run_cli(root, "apply-patches")
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1
    assert "sha256 mismatch" in err and "cannot download" in err and WHEEL in err
    assert cached.read_bytes() == b"truncated"  # nothing changed
    assert not (root / "build" / "sglang").exists()


def test_wrong_expected_hash_changes_nothing(root: Path, index) -> None:
    url, _ = index
    lay = layout(root)
    pin = load_pin(lay)
    pin["wheels"][WHEEL]["sha256"] = "0" * 64
    write_pin(lay, pin)
    cached = lay.cache / WHEEL
    before = cached.read_bytes()
    proc = run_cli(root, "apply-patches", env={"HARNESS_INDEX_URL": url})
    assert proc.returncode == 1
    assert "both have" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert cached.read_bytes() == before


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_apply_reaps_trees_left_by_a_killed_apply(root: Path) -> None:
    build = root / "build"
    pid = _dead_pid()
    left = [build / f".sglang-new-{pid}-k1ll3d", build / f".sglang-old-{pid}",
            build / ".sglang-new-x7Qz_2ab"]  # and the pid-less name older harnesses used
    for d in left:
        (d / "sglang" / ".git").mkdir(parents=True)
        (d / "sglang" / ".git" / "obj").write_text("x")
        (d / "sglang" / ".git" / "obj").chmod(0o444)
    live = build / f".check-{os.getpid()}-busy"  # a running process's scratch stays
    live.mkdir()
    proc = run_cli(root, "apply-patches")
    assert proc.returncode == 0, proc.stderr
    assert not any(d.exists() for d in left)
    assert live.exists()
    assert sum("left behind by an apply that was killed" in x for x in proc.stdout.splitlines()) == 3
    assert (build / "sglang" / ".git").is_dir()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_signal_mid_apply_cleans_up_its_own_tree(root: Path, sig: str) -> None:
    ok = run_cli(root, "apply-patches")
    assert ok.returncode == 0, ok.stderr
    head = (root / "build" / "sglang" / ".git" / "HEAD").read_text()
    # The signal arrives while the second patch is being applied into the new tree.
    code = (
        "import os, signal, sys\n"
        "import harness.patchset.apply as a\n"
        "orig, n = a.apply_one, []\n"
        "def apply_one(tree, patch):\n"
        "    n.append(patch)\n"
        f"    if len(n) == 2: os.kill(os.getpid(), signal.{sig})\n"
        "    return orig(tree, patch)\n"
        "a.apply_one = apply_one\n"
        "from harness.cli import main\n"
        "sys.exit(main(['apply-patches', '--force']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HARNESS_ROOT": str(root)})
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: apply-patches: stopped by {sig}"]
    assert [p.name for p in (root / "build").iterdir() if p.name.startswith(".")] == []
    assert (root / "build" / "sglang" / ".git" / "HEAD").read_text() == head  # old tree intact


def test_git_source_unreachable_fails_fast(root: Path) -> None:
    t0 = time.monotonic()
    proc = run_cli(root, "apply-patches", "--source", "git", env={"HARNESS_GIT_TIMEOUT": "20"})
    assert proc.returncode == 1
    assert "git clone" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 20


def test_git_source_without_a_commit_to_verify_refuses_offline(root: Path) -> None:
    pin_file = root / "patches" / "pin.json"
    pin = json.loads(pin_file.read_text())
    pin["git"].update(commit=None, commit_status="unverified: set from a trusted clone")
    pin_file.write_text(json.dumps(pin, indent=2) + "\n")
    proc = run_cli(root, "apply-patches", "--source", "git", env={"HARNESS_GIT_URL": "http://192.0.2.1/x.git"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: sglang 0.5.13.post1: pin.json has no git.commit to verify a clone against "
        "(unverified: set from a trusted clone); use SGLANG_SOURCE=wheel"]
    assert not (root / "build" / "sglang").exists()


def _upstream_repo(tmp_path: Path, root: Path) -> tuple[Path, str]:
    """A local 'upstream' repo whose python/sglang equals the fixture wheel tree."""
    lay = layout(root)
    apply_patches(lay)
    up = tmp_path / "upstream"
    up.mkdir()
    git(up, "init", "-q")
    subprocess.run(["cp", "-r", str(lay.tree / "python"), str(up)], check=True)
    subprocess.run(["git", "-C", str(lay.tree), "checkout", "-q", "base/v0.5.13.post1", "--", "."], check=True)
    subprocess.run(["rm", "-rf", str(up / "python")], check=True)
    subprocess.run(["cp", "-r", str(lay.tree / "python"), str(up)], check=True)
    subprocess.run(["git", "-C", str(lay.tree), "checkout", "-q", "patched", "--", "."], check=True)
    git(up, "add", "-A")
    git(up, "commit", "-qm", "release")
    git(up, "tag", "v0.5.13.post1")
    return up, git(up, "rev-parse", "HEAD").strip()


def test_git_source_commit_mismatch_and_match(root: Path, tmp_path: Path) -> None:
    up, commit = _upstream_repo(tmp_path, root)
    lay = layout(root)
    pin = load_pin(lay)
    pin["git"]["url"] = f"file://{up}"
    write_pin(lay, pin)
    with pytest.raises(HarnessError, match="pin mismatch"):
        apply_patches(lay, force=True, source="git")
    pin["git"]["commit"] = commit
    write_pin(lay, pin)
    assert apply_patches(lay, force=True, source="git") == "rebuilt"
    assert read_state(lay)["source"] == "git"
    assert "line_30 = 300" in (lay.tree / "python" / MOD).read_text()
