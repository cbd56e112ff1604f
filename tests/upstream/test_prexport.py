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


@pytest.mark.parametrize("base, pid", [
    (None, "dsv2-capture-final-layer"), (None, "aux-packer"),
    *(("0.5.23", p.stem.replace("_", "-"))
      for p in sorted((Path(__file__).resolve().parents[2] / "harness/upstream/templates/0.5.23").glob("*.py"))),
])
def test_templates_are_upstream_style(base, pid):
    path, src = template_for(pid, base)
    assert path.startswith("test/registered/") and Path(path).name.startswith("test_")
    assert "register_cpu_ci(" in src or "register_cuda_ci(" in src
    assert "unittest.main()" in src and 'if __name__ == "__main__":' in src
    assert "upstream-path" not in src and "harness" not in src
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


# ------------------------------------------------- bundles from another base (newest)

BASE = "9.9"
BUGGY = "def answer():\n    return 41\n"
FIXED = "def answer():\n    return 42\n"
UPSTREAM_TEST = '''\
# upstream-path: test/registered/unit/test_answer.py
import unittest

from sglang.answer import answer
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="base-a-test-cpu")


class TestAnswer(unittest.TestCase):
    def test_answer(self):
        self.assertEqual(answer(), 42)


if __name__ == "__main__":
    unittest.main()
'''


def _write_series(root: Path, tree: Path) -> None:
    """patches/<BASE>/ from the base tree's commits (the patch files and the series)."""
    for old in (root / "patches" / BASE).glob("0*.patch"):
        old.unlink()
    names = subprocess.run(["git", "format-patch", f"base/v{BASE}..HEAD", "-o", str(root / "patches" / BASE)],
                           cwd=tree, check=True, capture_output=True, text=True).stdout.split()
    (root / "patches" / BASE / "series").write_text("".join(Path(n).name + "\n" for n in names))


def _base_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str | None = UPSTREAM_TEST,
               later: str | None = None, later_template: str | None = None) -> Path:
    """A root with the pin plus base 9.9: a build tree at its base tag, a one-patch series
    (Forwarded: yes) that fixes ``sglang.answer``, and its upstream test template.
    ``later``: a second patch (Forwarded: no) that sets ``answer.py`` to that text;
    with ``later_template``, Forwarded: yes, with that upstream test."""
    import harness.upstream.prexport as prexport

    # The drift check after the export reads the package index: a dead one here, so it
    # prints "not checked" at once instead of reaching PyPI from a unit test.
    monkeypatch.setenv("HARNESS_INDEX_URL", "http://127.0.0.1:9/simple")
    root = tmp_path / "root"
    (root / "patches" / BASE).mkdir(parents=True)
    (root / "patches" / "pin.json").write_text(json.dumps({"version": PIN}))
    (root / "patches" / BASE / "pin.json").write_text(json.dumps({"version": BASE}))
    tree = root / "build" / f"sglang-{BASE}"
    pkg = tree / "python" / "sglang"
    (pkg / "test" / "ci").mkdir(parents=True)
    for d in (pkg, pkg / "test", pkg / "test" / "ci"):
        (d / "__init__.py").write_text("")
    (pkg / "test" / "ci" / "ci_register.py").write_text("def register_cpu_ci(**kw):\n    pass\n")
    (pkg / "answer.py").write_text(BUGGY)
    run_git(tree.parent, "init", "-q", tree.name)
    run_git(tree, "add", "-A")
    run_git(tree, "commit", "-q", "-m", "v9.9")
    run_git(tree, "tag", f"base/v{BASE}")
    (pkg / "answer.py").write_text(FIXED)
    run_git(tree, "commit", "-q", "-am",
            "Fix the answer\n\nBug: off by one.\n\nFix: return 42.\n\nPatch-Id: fix-answer\nForwarded: yes")
    if later is not None:
        (pkg / "answer.py").write_text(later)
        run_git(tree, "commit", "-q", "-am",
                "Change the answer\n\nBug: none.\n\nPatch-Id: change-answer\nForwarded: "
                + ("yes" if later_template else "no"))
    _write_series(root, tree)
    templates = tmp_path / "templates"
    (templates / BASE).mkdir(parents=True)
    if template is not None:
        (templates / BASE / "fix_answer.py").write_text(template)
    if later_template is not None:
        (templates / BASE / "change_answer.py").write_text(later_template)
    monkeypatch.setattr(prexport, "TEMPLATES", templates)
    return root


def test_bundle_from_base_is_verified_on_pristine_release(tmp_path, monkeypatch):
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch)
    [d] = export_from_base(layout(root, base=BASE))
    meta = json.loads((d / "bundle.json").read_text())
    assert meta["base_release"] == BASE and meta["deps"] == [] and not (d / "deps").exists()
    assert meta["test"] == "test/registered/unit/test_answer.py"
    assert meta["verified"]["apply_check"] == "ok"
    assert meta["verified"]["test_without_patch"].startswith("FAILED")
    assert meta["verified"]["test_with_patch"] == "OK"
    assert meta["verified"]["test_on_whole_series"] == "OK"
    [patch] = meta["patches"]
    text = (d / patch).read_text()
    # the fix and its test, in one commit, without our internal trailers
    assert "python/sglang/answer.py" in text and "test/registered/unit/test_answer.py" in text
    assert "Patch-Id:" not in text and "Forwarded:" not in text
    desc = (d / "description.md").read_text()
    assert "2 files changed" in desc  # the stat covers the fix, not only the test
    assert "AssertionError: 41 != 42" in desc and "passes (exit 0" in desc
    assert str(tmp_path) not in desc
    # SGLang's pull-request template, the motivation without the fork's "Bug:" label,
    # and how the PR relates to each upstream thread on aux capture
    from harness.upstream.prbody import THREADS, fork_markers

    heads = [x for x in desc.splitlines() if x.startswith("## ")]
    assert heads == ["## Motivation", "## Modifications", "## Related", "## Accuracy Tests",
                     "## Benchmarking and Tests", "## Checklist"]
    assert "\n\nOff by one." in desc and "Bug:" not in desc and "Return 42." in desc
    # a capture PR of no kind of its own: the threads it relates to by default in one
    # line, not a table of "independent" rows
    assert all(f"#{n} (" in desc for n, _, _ in THREADS) and "| thread |" not in desc
    assert fork_markers(desc) == []
    # and it applies to a pristine checkout of the release
    check = tmp_path / "check"
    run_git(tmp_path, "clone", "-q", str(root / "build" / f"sglang-{BASE}"), str(check))
    run_git(check, "checkout", "-q", f"base/v{BASE}")
    run_git(check, "apply", "--check", str(d / patch))


def test_bundle_evidence_shows_the_reviewers_paths(tmp_path):
    """description.md quotes the runs' tracebacks: paths relative to the SGLang checkout
    and to site-packages, as on the reviewer's machine, never this machine's."""
    from harness.upstream.prexport import _test_result

    tree = tmp_path / "build" / "pr-trees-9.9" / "without"
    log = tmp_path / "without.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        f'  File "{tree}/python/sglang/test/test_utils.py", line 2452, in _callTestMethod\n'
        f'  File "{tmp_path}/.tox/test/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in f\n'
        f'  File "{tmp_path}/harness/zygote.py", line 111, in _run_as_main\n'
        "    runpy.run_path(test_path, run_name=\"__main__\")\n"
        "AttributeError: 'X' object has no attribute 'get_aux_hidden_states_width'\n"
        "FAILED (errors=1)\n")
    res = _test_result(1, log, tree)
    assert res["tail"][1] == '  File "python/sglang/test/test_utils.py", line 2452, in _callTestMethod'
    assert res["tail"][2].startswith('  File "site-packages/torch/nn/modules/module.py"')
    assert not any(str(tmp_path) in x for x in res["tail"]) and res["summary"] == "FAILED (errors=1)"
    # the runner's own frame (it runs the test as __main__) is not the reviewer's
    assert not any("zygote" in x or "runpy" in x for x in res["tail"])


def test_bundle_test_must_pass_on_the_whole_series(tmp_path, monkeypatch):
    """Merged in series order, a later patch must not break an earlier bundle's test."""
    from harness import HarnessError
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, later=FIXED.replace("42", "43"))
    with pytest.raises(HarnessError) as exc:
        export_from_base(layout(root, base=BASE))
    msg = str(exc.value)
    assert "fix-answer: test/registered/unit/test_answer.py fails on the whole 9.9 series" in msg
    assert "43 != 42" in msg and len(msg.splitlines()) == 1
    meta = json.loads((root / "build" / "pr" / "fix-answer" / "bundle.json").read_text())
    assert meta["verified"]["test_on_whole_series"].startswith("FAILED")


def test_only_still_checks_the_other_bundles_on_the_whole_series(tmp_path, monkeypatch):
    """``--only`` a later patch: the earlier bundles' tests run on the whole series too,
    since the later patch can break them (as a packer family broke models-capture-final-layer's template)."""
    from harness import HarnessError
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, later=FIXED.replace("42", "43"),
                      later_template=UPSTREAM_TEST.replace("test_answer", "test_change").replace("42", "43"))
    with pytest.raises(HarnessError) as exc:
        export_from_base(layout(root, base=BASE), only=["change-answer"])
    msg = str(exc.value)
    assert msg.startswith("fix-answer: test/registered/unit/test_answer.py fails on the whole 9.9 series")
    assert "change-answer" not in msg and len(msg.splitlines()) == 1
    meta = json.loads((root / "build" / "pr" / "change-answer" / "bundle.json").read_text())
    assert meta["deps"] == ["fix-answer"] and meta["verified"]["test_on_whole_series"] == "OK"
    assert not (root / "build" / "pr" / "fix-answer").exists()


def test_bundle_from_base_rejects_a_test_that_passes_without_the_patch(tmp_path, monkeypatch):
    from harness import HarnessError
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, template=UPSTREAM_TEST.replace("42)", "answer())"))
    with pytest.raises(HarnessError, match="passes on pristine 9.9 without"):
        export_from_base(layout(root, base=BASE))


def test_bundle_from_base_needs_a_template(tmp_path, monkeypatch):
    from harness import HarnessError
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, template=None)
    with pytest.raises(HarnessError, match=r"no upstream test template .*9.9/fix_answer.py"):
        export_from_base(layout(root, base=BASE))


def test_every_forwarded_unit_of_another_base_has_a_template():
    """Every upstream PR of a base (a patch, or a bundle of patches: bundles.toml) has its
    test template, and no template is left over from a patch now in a bundle."""
    from harness.patchset.layout import bases
    from harness.upstream import bundles
    from harness.upstream.prexport import TEMPLATES
    from harness.upstream.status import load_series

    root = Path(__file__).resolve().parents[2]
    for base in bases(root):
        units = bundles.load(TEMPLATES / base, load_series(layout(root, base=base)))
        missing = [u.id for u in units if u.forwarded and template_for(u.id, base) is None]
        assert not missing, f"patches/{base}: no templates/{base}/ test for {missing}"
        ids = {u.id for u in units}
        stale = [p.stem for p in (TEMPLATES / base).glob("*.py") if p.stem.replace("_", "-") not in ids]
        assert not stale, f"templates/{base}/: no unit of the series for {stale}"


def test_a_bundle_is_one_pr_of_its_patches(tmp_path, monkeypatch):
    """bundles.toml groups consecutive patches into one PR: one commit with both changes
    and the bundle's test, one body with both motivations, verified as one (fails on the
    release, passes with both); a member's own earlier bundle is removed."""
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, later="def answer():\n    return 6 * 7\n",
                      later_template=UPSTREAM_TEST)
    templates = tmp_path / "templates" / BASE
    (templates / "fix_answer.py").rename(templates / "answer_fixed.py")
    (templates / "change_answer.py").unlink()
    (templates / "bundles.toml").write_text(
        '[[bundle]]\nid = "answer-fixed"\ntitle = "Fix and restate the answer"\n'
        'patches = ["fix-answer", "change-answer"]\n')
    stale = root / "build" / "pr" / "fix-answer"
    stale.mkdir(parents=True)
    [d] = export_from_base(layout(root, base=BASE))
    assert d.name == "answer-fixed" and not stale.exists()
    meta = json.loads((d / "bundle.json").read_text())
    assert meta["members"] == ["fix-answer", "change-answer"] and meta["deps"] == []
    assert meta["verified"]["test_without_patch"].startswith("FAILED")
    assert meta["verified"]["test_with_patch"] == "OK"
    [patch] = meta["patches"]
    text = (d / patch).read_text()
    assert "Subject: Fix and restate the answer" in text and "return 6 * 7" in text
    assert "Off by one." in text and "None." in text and "Patch-Id" not in text
    assert "Testing: test/registered/unit/test_answer.py (CPU only" in text
    desc = (d / "description.md").read_text()
    assert desc.startswith("# Fix and restate the answer") and "Return 42." in desc


def test_bundles_toml_errors_are_one_line(tmp_path):
    """A malformed bundles.toml: one error naming the file and what is wrong."""
    from types import SimpleNamespace as P

    from harness import HarnessError
    from harness.upstream import bundles

    series = [P(id=i, subject=i, forwarded=True, files=[f"{i}.py"], trailers={}) for i in "abcd"]
    series[2].files.append("a.py")
    cases = {
        '[[bundle]]\nid = "x"\ntitle = "t"\npatches = ["c", "a"]\n': "not listed once each in series order",
        '[[bundle]]\nid = "x"\ntitle = "t"\npatches = ["a", "d"]\n': "x: c, between its patches, touches a.py",
        '[[bundle]]\nid = "x"\ntitle = "t"\npatches = ["a", "z"]\n': "no such patch in the series: z",
        '[[bundle]]\nid = "x"\npatches = ["a"]\n': "needs id, title and patches",
        '[needs]\n"a" = ["d"]\n': "a needs d, which comes after it",
        '[needs]\n"q*" = ["a"]\n': "names no unit",
        '[[bundle]\n': "bundles.toml:",
    }
    for text, want in cases.items():
        (tmp_path / "bundles.toml").write_text(text)
        with pytest.raises(HarnessError) as exc:
            bundles.load(tmp_path, series)
        assert want in str(exc.value) and len(str(exc.value).splitlines()) == 1, text
    (tmp_path / "bundles.toml").write_text(
        '[[bundle]]\nid = "ab"\ntitle = "t"\npatches = ["a", "b"]\n[needs]\n"[cd]" = ["ab"]\n"d" = "c"\n')
    units = bundles.load(tmp_path, series)
    assert [u.id for u in units] == ["ab", "c", "d"]
    (tmp_path / "bundles.toml").write_text('[[bundle]]\nid = "bd"\ntitle = "t"\npatches = ["b", "d"]\n')
    assert [u.id for u in bundles.load(tmp_path, series)] == ["a", "bd", "c"]  # c touches neither
    assert [m.id for m in bundles.needed_patches(units, units[2])] == ["a", "b", "c"]


def test_a_needed_unit_is_stacked_under_a_patch_that_does_not_overlap_it(tmp_path, monkeypatch):
    """``needs``: a patch that imports what an earlier one adds, in a file it does not
    touch, gets that patch in its deps/ (file overlap alone would leave it out, and the
    bundle's test would fail with the patch on the bare release)."""
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch)
    tree = root / "build" / f"sglang-{BASE}"
    pkg = tree / "python" / "sglang"
    (pkg / "user.py").write_text("from sglang.answer import answer\n\n\ndef doubled():\n    return 2 * answer()\n")
    run_git(tree, "add", "-A")
    run_git(tree, "commit", "-q", "-m", "Double it\n\nBug: none.\n\nFix: twice.\n\nPatch-Id: double-answer\nForwarded: yes")
    _write_series(root, tree)
    templates = tmp_path / "templates" / BASE
    (templates / "double_answer.py").write_text(UPSTREAM_TEST.replace("test_answer.py", "test_double.py").replace(
        "from sglang.answer import answer", "from sglang.user import doubled").replace(
        "self.assertEqual(answer(), 42)", "self.assertEqual(doubled(), 84)"))
    (templates / "bundles.toml").write_text('[needs]\n"double-answer" = ["fix-answer"]\n')
    written = export_from_base(layout(root, base=BASE), only=["double-answer"])
    meta = json.loads((written[0] / "bundle.json").read_text())
    assert meta["deps"] == ["fix-answer"] and meta["verified"]["test_with_patch"] == "OK"
    # without it the new file alone applies, and its test fails (82 != 84)
    (templates / "bundles.toml").unlink()
    from harness import HarnessError

    with pytest.raises(HarnessError, match="fails on 9.9 with"):
        export_from_base(layout(root, base=BASE), only=["double-answer"])


def test_strip_trailers_drops_the_fork_only_paragraphs():
    from harness.upstream.prexport import fork_paths

    body = ("Bug: x.\n\nFix: y.\n\nTesting: test/registered/unit/test_x.py fails without.\n\n"
            "Fork-Testing: tests/multirank/test_m.py; `make ablation BASE=0.5.23`.\n\n"
            "Patch-Id: x\nForwarded: yes")
    upstream = strip_trailers(body)
    assert upstream == "Bug: x.\n\nFix: y.\n\nTesting: test/registered/unit/test_x.py fails without."
    assert fork_paths(upstream) == []
    assert fork_paths(body) == ["BASE=0.5.23`.", "make ablation", "tests/multirank/test_m.py;"]


def test_deps_are_the_prefix_that_overlaps_the_patch():
    """A bundle's deps: the earlier patches on its files, and on theirs (transitively);
    an earlier patch on files of its own (another family) stays out."""
    from types import SimpleNamespace as P

    from harness.upstream.prexport import _walk

    core = P(id="core", files=["a.py", "b.py"])
    family_b = P(id="b", files=["b.py"])
    other = P(id="other", files=["c.py"])
    first = P(id="first", files=["a.py", "d.py"])
    unrelated = P(id="unrelated", files=["e.py"])
    prefix = [unrelated, first, core, other, family_b]
    def walk(files):
        return _walk(prefix, set(files), set(), lambda q: [])

    assert [q.id for q in walk(["b.py"])] == ["first", "core", "b"]
    assert [q.id for q in walk(["c.py"])] == ["other"]
    assert walk(["f.py"]) == []


def test_bundle_test_trees_are_reused_and_reset(tmp_path, monkeypatch):
    """The test trees stay between exports (so SGLang's bytecode stays compiled), each
    reset to the release: a second export verifies the same way, and leaves no file of
    the first behind."""
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch)
    lay = layout(root, base=BASE)
    export_from_base(lay)
    stray = lay.pr_trees / "without" / "python" / "sglang" / "stray.py"
    stray.write_text("")
    written = export_from_base(lay)
    meta = json.loads((written[0] / "bundle.json").read_text())
    assert meta["verified"]["test_without_patch"].startswith("FAILED")
    assert meta["verified"]["test_with_patch"].startswith("OK")
    assert not stray.exists()


def test_one_export_at_a_time_on_the_test_trees(tmp_path, monkeypatch):
    """A second pr-export while one holds the trees: one line that says so, nothing built."""
    from harness import HarnessError
    from harness.upstream.prexport import _lock_trees, export_from_base

    root = _base_root(tmp_path, monkeypatch)
    lay = layout(root, base=BASE)
    held = _lock_trees(lay)
    try:
        with pytest.raises(HarnessError) as exc:
            export_from_base(lay)
    finally:
        held.close()
    assert "in use by another pr-export" in str(exc.value) and len(str(exc.value).splitlines()) == 1
    assert not (root / "build" / "pr").exists()


def test_pr_body_fork_markers():
    """What pr-export refuses in a bundle body: the fork's trailers and sections, its test
    paths and targets, this machine's paths."""
    from harness.upstream.prbody import fork_markers

    assert fork_markers("Fix: x.\n\nRelated:\n- https://github.com/sgl-project/sglang/pull/1") == []
    body = ("Patch-Id: x\nFork-Testing: y\nsee tests/patches/test_a.py and make ablation "
            "on /work/main/build, harness/upstream/x.py")
    assert fork_markers(body) == ["/work/main/build,", "Fork-Testing:", "Patch-Id:",
                                  "harness/upstream/x.py", "make ablation", "tests/patches/test_a.py"]


def test_a_patch_no_longer_forwarded_loses_its_earlier_bundle(tmp_path, monkeypatch):
    """A bundle written while its patch was forwarded is removed once it is not: a PR
    directory in build/pr is one to open."""
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch, later="def answer():\n    return 6 * 7\n")
    stale = root / "build" / "pr" / "change-answer"
    stale.mkdir(parents=True)
    (stale / "description.md").write_text("old\n")
    [d] = export_from_base(layout(root, base=BASE))
    assert d.name == "fix-answer" and not stale.exists()


def test_test_code_a_bundle_adds_runs_without_the_change_too(tmp_path, monkeypatch):
    """A bundle that adds shared test code (python/sglang/test/) beside its test: the run
    without the change has that code too, so the test fails on the bug (41 != 42), not
    on the import of a module the release lacks."""
    from harness.upstream.prexport import export_from_base

    root = _base_root(tmp_path, monkeypatch,
                      template=UPSTREAM_TEST.replace("self.assertEqual(answer(), 42)", "self.assertEqual(answer(), EXPECTED)")
                      .replace("from sglang.answer import answer", "from sglang.answer import answer\nfrom sglang.test.expect import EXPECTED"))
    tree = root / "build" / f"sglang-{BASE}"
    (tree / "python" / "sglang" / "test" / "expect.py").write_text("EXPECTED = 42\n")
    run_git(tree, "add", "-A")
    run_git(tree, "commit", "-q", "--amend", "--no-edit")
    _write_series(root, tree)
    [d] = export_from_base(layout(root, base=BASE))
    meta = json.loads((d / "bundle.json").read_text())
    assert meta["verified"]["test_without_patch"] == "FAILED (failures=1)"
    assert meta["verified"]["test_with_patch"] == "OK"
    desc = (d / "description.md").read_text()
    assert "AssertionError: 41 != 42" in desc and "ModuleNotFoundError" not in desc
    assert "python/sglang/test/expect.py" in (d / meta["patches"][0]).read_text()


def test_a_bundle_text_keeps_its_tables_line_by_line():
    """bundles.toml prose is wrapped at 72 columns; a measured table stays a table."""
    from harness.upstream.bundles import _fill

    text = """
    A measured figure, long enough that this sentence must wrap once it runs past the
    seventy-second column of the commit body.

    | stage | before | after |
    | --- | ---: | ---: |
    | first | 112 MiB | 56 MiB |
    """
    prose, table = _fill(text).split("\n\n")
    assert all(len(line) <= 72 for line in prose.splitlines()) and "\n" in prose
    assert table.splitlines() == ["| stage | before | after |", "| --- | ---: | ---: |",
                                  "| first | 112 MiB | 56 MiB |"]


def test_thread_table_holds_the_threads_a_pr_relates_to():
    """A packer PR tabulates its own relations (#28956, #40159, #33444) and names the
    rest in one line; the final-layer PR keeps pre-norm and leaves #39776's post-norm
    capture to the PR that adds the choice, which gives it."""
    from harness.upstream.prbody import thread_lines

    packer = "\n".join(thread_lines("gemma4-aux-packer"))
    assert "| #28956 |" in packer and "| #33444 |" in packer and "| #32206 |" not in packer
    assert "Otherwise independent" in packer and "#32206 (" in packer
    final = "\n".join(thread_lines("models-capture-final-layer"))
    row = next(x for x in final.splitlines() if x.startswith("| #39776 |"))
    assert "separate PR" in row and "gives what it asked for" not in row
    choice = "\n".join(thread_lines("final-layer-capture"))
    row = next(x for x in choice.splitlines() if x.startswith("| #39776 |"))
    assert "gives what it asked for" in row


def test_stack_is_each_bundles_longest_chain_of_prs_to_merge_first():
    from harness import HarnessError
    from harness.upstream.bundles import stack

    g = stack({"infra": [], "final": [], "plain": ["infra"], "vl": ["plain", "infra"],
               "deprecate": ["vl", "plain"], "alone": []})
    assert g["depth"] == {"infra": 1, "final": 1, "plain": 2, "vl": 3, "deprecate": 4, "alone": 1}
    assert g["max_depth"] == 4 and g["deepest"] == ["infra", "plain", "vl", "deprecate"]
    with pytest.raises(HarnessError, match="circle: a -> b -> a"):
        stack({"a": ["b"], "b": ["a"]})


def test_stack_json_is_written_and_a_depth_over_the_limit_refused(tmp_path):
    from harness import HarnessError
    import types

    from harness.upstream.prexport import write_stack

    units = [types.SimpleNamespace(id="infra", ids=["packer-checked", "infra"]),
             types.SimpleNamespace(id="plain", ids=["llama-packer", "qwen-packer"]),
             types.SimpleNamespace(id="vl", ids=["vl"])]
    for bid, deps in (("infra", []), ("plain", ["packer-checked", "infra"]), ("vl", ["qwen-packer"])):
        (tmp_path / bid).mkdir()
        (tmp_path / bid / "bundle.json").write_text(json.dumps({"id": bid, "deps": deps}))
    lay = types.SimpleNamespace(rel=lambda p: p.name)
    g = write_stack(lay, tmp_path, units, None)
    assert json.loads((tmp_path / "stack.json").read_text())["needs"] == {
        "infra": [], "plain": ["infra"], "vl": ["plain"]}
    assert g["max_depth"] == 3
    assert write_stack(lay, tmp_path, units, 3)["max_depth"] == 3
    with pytest.raises(HarnessError, match=r"vl stacks 3 PRs deep \(infra -> plain -> vl\), over --max-depth 2"):
        write_stack(lay, tmp_path, units, 2)


def test_bundles_toml_max_depth_is_the_exports_default_limit(tmp_path):
    """``max_depth`` at the top of a base's bundles.toml is the deepest chain the export
    accepts without --max-depth (a ratchet); absent, nothing is refused; anything but a
    whole number of PRs is one line naming the file."""
    from harness import HarnessError
    from harness.upstream import bundles

    assert bundles.max_depth(tmp_path) is None
    (tmp_path / "bundles.toml").write_text('max_depth = 5\n\n[[bundle]]\nid = "x"\n')
    assert bundles.max_depth(tmp_path) == 5
    for bad in ("0", '"5"', "true", "2.5"):
        (tmp_path / "bundles.toml").write_text(f"max_depth = {bad}\n")
        with pytest.raises(HarnessError, match=r"^bundles.toml: max_depth = .*: a whole number of PRs, 1 or more$"):
            bundles.max_depth(tmp_path)
    shipped = Path(__file__).resolve().parents[2] / "harness/upstream/templates/0.5.23"
    assert bundles.max_depth(shipped) is not None


def test_stack_counts_only_the_series_bundles(tmp_path):
    """A bundle directory left from an id the series no longer has (a renamed bundle) is
    not part of the stack."""
    import types

    from harness.upstream.prexport import write_stack

    units = [types.SimpleNamespace(id="infra", ids=["infra"]), types.SimpleNamespace(id="vl", ids=["vl"])]
    for bid, deps in (("infra", []), ("vl", ["infra"]), ("old-name", ["vl"])):
        (tmp_path / bid).mkdir()
        (tmp_path / bid / "bundle.json").write_text(json.dumps({"id": bid, "deps": deps}))
    g = write_stack(types.SimpleNamespace(rel=lambda p: p.name), tmp_path, units, None)
    assert g["needs"] == {"infra": [], "vl": ["infra"]} and g["max_depth"] == 2
