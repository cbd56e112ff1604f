"""export-patches, check-patches, build-wheel (offline fixtures)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import pytest

from harness import HarnessError
from harness.patchset.apply import apply_patches
from harness.patchset.check import check_patches
from harness.patchset.export import export_patches
from harness.patchset.layout import layout
from harness.patchset.series import series_id
from harness.patchset.wheel import build_wheel, wheel_path

from .conftest import MOD, VERSION, commit_change, git


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_apply_export_round_trip_is_byte_identical(root: Path) -> None:
    lay = layout(root)
    before = snapshot(lay.patches)
    apply_patches(lay)
    export_patches(lay)
    assert snapshot(lay.patches) == before
    assert apply_patches(lay) == "up to date"


def test_export_new_commit_then_apply_is_noop(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    commit_change(lay.tree, "python/" + MOD, "line_20 = 20\n", "line_20 = 200\n", "third-fix", "Fix line twenty")
    names = export_patches(lay)
    assert names[-1] == "0003-Fix-line-twenty.patch"
    assert (lay.patches / "series").read_text().startswith("# test series\n")
    assert apply_patches(lay) == "up to date"
    # determinism: a forced rebuild + export changes nothing
    before = snapshot(lay.patches)
    apply_patches(lay, force=True)
    export_patches(lay)
    assert snapshot(lay.patches) == before


def test_export_drops_removed_patches_and_amend(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    git(lay.tree, "reset", "-q", "--hard", "HEAD~1")
    export_patches(lay)
    assert not (lay.patches / "0002-Fix-line-thirty.patch").exists()
    assert "0002" not in (lay.patches / "series").read_text()


def test_export_refuses_uncommitted(root: Path) -> None:
    lay = layout(root)
    apply_patches(lay)
    (lay.tree / "python" / MOD).write_text("x\n")
    with pytest.raises(HarnessError, match="uncommitted"):
        export_patches(lay)


def test_check_ok(root: Path) -> None:
    assert check_patches(layout(root), style=False) == []


def test_check_lint_failures(root: Path) -> None:
    lay = layout(root)
    p1 = lay.patches / "0001-Fix-line-ten.patch"
    p1.write_text(p1.read_text().replace("Forwarded: no\n", ""))
    p2 = lay.patches / "0002-Fix-line-thirty.patch"
    p2.write_text(p2.read_text().replace("Patch-Id: second-fix", "Patch-Id: first-fix"))
    shutil.copy(p1, lay.patches / "0009-unlisted.patch")
    series = lay.series_file
    series.write_text(series.read_text() + "0001-Fix-line-ten.patch\n0005-missing.patch\n")
    problems = check_patches(lay, style=False)
    text = "\n".join(problems)
    assert "0009-unlisted.patch exists but is not listed" in text
    assert "0005-missing.patch listed but missing" in text
    assert "0001-Fix-line-ten.patch listed more than once" in text
    assert "0001-Fix-line-ten.patch: missing trailer Forwarded:" in text
    assert "Patch-Id first-fix also used by" in text


def test_check_one_author_for_the_series(root: Path) -> None:
    lay = layout(root)
    p2 = lay.patches / "0002-Fix-line-thirty.patch"
    first = next(x for x in (lay.patches / "0001-Fix-line-ten.patch").read_text().splitlines()
                 if x.startswith("From: "))
    p2.write_text(p2.read_text().replace(first, "From: Some Session <session@example.invalid>"))
    text = "\n".join(check_patches(lay, style=False))
    assert ("0002-Fix-line-thirty.patch: author 'Some Session <session@example.invalid>', "
            f"not the series' {first[len('From: '):]!r}") in text


def test_check_detects_fuzz_and_round_trip_drift(root: Path) -> None:
    lay = layout(root)
    p = lay.patches / "0002-Fix-line-thirty.patch"
    p.write_text(p.read_text().replace("Date: ", "X-Extra: 1\nDate: "))
    problems = check_patches(lay, style=False)
    assert any("round trip: 0002-Fix-line-thirty.patch differs" in x for x in problems)
    p.write_text(p.read_text().replace("@@ -27,7 +27,7 @@", "@@ -25,7 +25,7 @@"))
    problems = check_patches(lay, style=False)
    assert any(x.startswith("apply:") and "offset" in x for x in problems)


def test_build_wheel_version_and_record(root: Path) -> None:
    lay = layout(root)
    out = build_wheel(lay)
    sid = series_id(lay)
    ver = f"{VERSION}+auxcap.{sid}"
    assert out.name == f"sglang-{ver}-cp311-cp311-manylinux_2_34_x86_64.whl"
    assert wheel_path(lay)[0] == out
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert names == sorted(n for n in names if ".dist-info/" not in n) + [n for n in names if ".dist-info/" in n]
        info = f"sglang-{ver}.dist-info/"
        assert f"Version: {ver}\n" in zf.read(info + "METADATA").decode()
        assert f"'{ver}'" in zf.read("sglang/_version.py").decode()
        assert "line_10 = 100" in zf.read(MOD).decode()
        assert "sglang/srt/_core.cpython-311-x86_64-linux-gnu.so" in names
        assert "tools/helper.py" in names
        assert {i.date_time for i in zf.infolist()} == {(2026, 6, 15, 0, 0, 0)}
        rows = list(csv.reader(io.StringIO(zf.read(info + "RECORD").decode())))
        assert {r[0] for r in rows} == set(names)
        for name, digest, size in rows:
            if name == info + "RECORD":
                assert digest == "" and size == ""
                continue
            data = zf.read(name)
            b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={b64}" and int(size) == len(data)
    first = out.read_bytes()
    out.unlink()
    assert build_wheel(lay).read_bytes() == first  # deterministic
    mtime = out.stat().st_mtime_ns
    build_wheel(lay)
    assert out.stat().st_mtime_ns == mtime  # no-op when present


def test_style_hook_flags_badly_formatted_patch(root: Path) -> None:
    pytest.importorskip("black")
    lay = layout(root)
    apply_patches(lay)
    commit_change(lay.tree, "python/" + MOD, "line_20 = 20\n", "line_20   =   20\n", "ugly", "Ugly")
    export_patches(lay)
    problems = check_patches(lay)
    assert any(x.startswith("style: black:") and MOD in x for x in problems)


def test_style_flags_a_pr_test_template_as_it_goes_upstream(root: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    """check-patches holds each PR test template (harness/upstream/templates/) to the
    base's style, without a baseline: it is a new file upstream. The
    ``# upstream-path:`` line, which pr-export drops, is not what is checked."""
    pytest.importorskip("black")
    from harness.patchset import check

    lay = layout(root)
    apply_patches(lay)
    export_patches(lay)
    templates = tmp_path / "templates"
    templates.mkdir()
    clean = "# upstream-path: test/registered/unit/test_x.py\nx = 1\n"
    (templates / "clean.py").write_text(clean)
    monkeypatch.setattr(check, "TEMPLATES", templates)
    assert not [p for p in check_patches(lay) if "template" in p]
    (templates / "ugly.py").write_text("x   =   1\n")
    problems = [p for p in check_patches(lay) if "template" in p]
    assert len(problems) == 1 and problems[0].startswith("style: black: ")
    assert "ugly.py" in problems[0] and "clean.py" not in problems[0]
