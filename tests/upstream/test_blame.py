"""pr-export's deps by the lines a patch reads (harness/upstream/blame.py), on a
synthetic series in a local git repo (offline, no SGLang)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.upstream.blame import SeriesLines, Unreadable, preimage_ranges
from harness.upstream.prexport import _apply_alone_or_with_prefix, _walk
from harness.upstream.status import Patch

from .fixtures import run_git

LINES = [f"line {i}\n" for i in range(1, 41)]


def _series(tmp_path: Path, edits: list[tuple[str, dict[int, str | None]]]) -> tuple[Path, list[Patch]]:
    """A release (``a.py``, 40 lines, tag ``base``) and one commit per edit: ``{line:
    text}`` sets a line (1-based, in the file as the edit finds it), None deletes it.
    Returned: the repo and the series' patches (``git format-patch``)."""
    repo = tmp_path / "tree"
    repo.mkdir()
    run_git(repo, "init", "-q")
    (repo / "a.py").write_text("".join(LINES))
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "release")
    run_git(repo, "tag", "base")
    for pid, edit in edits:
        lines = (repo / "a.py").read_text().splitlines(keepends=True)
        for n in sorted(edit, reverse=True):
            if edit[n] is None:
                del lines[n - 1]
            else:
                lines[n - 1] = edit[n] + "\n"
        (repo / "a.py").write_text("".join(lines))
        run_git(repo, "commit", "-q", "-am", f"{pid}\n\nPatch-Id: {pid}\nForwarded: yes")
    names = run_git(repo, "format-patch", "base..HEAD", "-o", str(tmp_path / "patches")).split()
    return repo, [Patch.from_file(Path(n)) for n in names]


def _release(tmp_path: Path, repo: Path) -> Path:
    """A checkout of the release (tag ``base``) of ``repo``, for a unit's deps to go on."""
    pristine = tmp_path / "pr"
    run_git(tmp_path, "clone", "-q", "--shared", str(repo), str(pristine))
    run_git(pristine, "checkout", "-q", "base")
    return pristine


def _unit(p: Patch) -> SimpleNamespace:
    return SimpleNamespace(id=p.id, members=[p], files=p.files)


def test_preimage_ranges_are_the_hunks_old_lines():
    text = ("Subject\n\n--- a/not-a-header.py\n---\n diff\n"
            "diff --git a/x.py b/x.py\nindex 1..2 100644\n--- a/x.py\n+++ b/x.py\n"
            "@@ -4,7 +4,7 @@ def f():\n ctx\n--- a removed line that looks like a header\n+new\n"
            "@@ -30 +30 @@\n-x\n+y\n\\ No newline at end of file\n"
            "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+z\n"
            "diff --git a/a b.py b/a b.py\n--- a/a b.py\t\n+++ b/a b.py\t\n@@ -2,0 +3 @@\n+w\n@@ -9,2 +10,2 @@\n")
    assert preimage_ranges(text) == {"x.py": [(4, 7), (30, 1)], "a b.py": [(9, 2)]}
    with pytest.raises(Unreadable, match="a quoted path"):
        preimage_ranges('diff --git "a/\\303\\251.py" "b/\\303\\251.py"\n--- "a/\\303\\251.py"\n')


def test_a_patch_reads_the_earlier_patch_whose_lines_it_edits_not_one_elsewhere_in_the_file(tmp_path):
    repo, (first, far, third) = _series(tmp_path, [("first", {5: "five"}), ("far", {30: "thirty"}),
                                                   ("third", {7: "seven"})])
    lines = SeriesLines(repo, "base", [first, far, third])
    assert lines.reads(2) == {0} and lines.reads(1) == set() and lines.reads(0) == set()
    # the file walk takes both: each touches a.py
    assert [q.id for q in _walk([first, far], {"a.py"}, set(), lambda q: [])] == ["first", "far"]

    pristine = _release(tmp_path, repo)
    deps, how = _apply_alone_or_with_prefix(pristine, _unit(third), [first, far], "9.9", lines=lines,
                                            members_of=lambda q: [q])
    assert ([q.id for q in deps], how) == (["first"], "lines")
    assert "five" in (pristine / "a.py").read_text() and "thirty" not in (pristine / "a.py").read_text()


def test_a_unit_taken_by_its_lines_comes_whole_with_what_it_needs(tmp_path):
    repo, (base_fix, sibling, needed, third) = _series(tmp_path, [
        ("base-fix", {5: "five"}), ("sibling", {20: "twenty"}), ("needed", {35: "thirty-five"}),
        ("third", {7: "seven"})])
    lines = SeriesLines(repo, "base", [base_fix, sibling, needed, third])
    bundle = {"base-fix": [base_fix, sibling], "sibling": [base_fix, sibling]}
    needs = {"base-fix": [needed], "sibling": [needed]}
    pristine = _release(tmp_path, repo)
    deps, how = _apply_alone_or_with_prefix(pristine, _unit(third), [base_fix, sibling, needed], "9.9",
                                            needs_of=lambda q: needs.get(q.id, []), lines=lines,
                                            members_of=lambda q: bundle.get(q.id, [q]))
    assert ([q.id for q in deps], how) == (["base-fix", "sibling", "needed"], "lines")


def test_a_line_deleted_inside_the_hunk_is_invisible_to_blame_so_the_file_walk_takes_over(tmp_path):
    repo, (first, deleting, third) = _series(tmp_path, [("first", {5: "five"}), ("deleting", {9: None}),
                                                        ("third", {7: "seven"})])
    lines = SeriesLines(repo, "base", [first, deleting, third])
    assert lines.reads(2) == {0}  # the deleted line 9 leaves no trace
    pristine = _release(tmp_path, repo)
    deps, how = _apply_alone_or_with_prefix(pristine, _unit(third), [first, deleting], "9.9", lines=lines,
                                            members_of=lambda q: [q])
    assert [q.id for q in deps] == ["first", "deleting"]
    assert how.startswith("files (on the patches it reads, ") and third.name in how


def test_a_patch_that_applies_alone_needs_nothing(tmp_path):
    repo, (first, far) = _series(tmp_path, [("first", {5: "five"}), ("far", {30: "thirty"})])
    pristine = _release(tmp_path, repo)
    deps, how = _apply_alone_or_with_prefix(pristine, _unit(far), [first], "9.9",
                                            lines=SeriesLines(repo, "base", [first, far]))
    assert (deps, how) == ([], "needs")


def test_a_patch_whose_lines_cannot_be_read_falls_back_to_the_file_walk(tmp_path, monkeypatch):
    repo, (first, far, third) = _series(tmp_path, [("first", {5: "five"}), ("far", {30: "thirty"}),
                                                   ("third", {7: "seven"})])
    lines = SeriesLines(repo, "base", [first, far, third])

    def unreadable(i):
        raise Unreadable("git blame a.py: fatal: no such path")

    monkeypatch.setattr(lines, "reads", unreadable)
    pristine = _release(tmp_path, repo)
    deps, how = _apply_alone_or_with_prefix(pristine, _unit(third), [first, far], "9.9", lines=lines)
    assert [q.id for q in deps] == ["first", "far"]
    assert how == "files (the lines it reads cannot be told: git blame a.py: fatal: no such path)"


def test_stale_bundles_of_this_release_go_and_another_bases_stay(tmp_path):
    import json

    from harness.upstream.prexport import _remove_stale

    for bid, meta in (("kept", {"base_release": "9.9", "members": ["kept"]}),
                      ("renamed", {"base_release": "9.9", "members": ["x"]}),
                      ("pin-bundle", {"base_release": "9.8"}),
                      ("no-members", {"base_release": "9.9"})):
        (tmp_path / bid).mkdir()
        (tmp_path / bid / "bundle.json").write_text(json.dumps({"id": bid, **meta}))
    lay = SimpleNamespace(rel=lambda p: p.name)
    _remove_stale(lay, tmp_path, [SimpleNamespace(id="kept")], "9.9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "no-members", "pin-bundle"]
