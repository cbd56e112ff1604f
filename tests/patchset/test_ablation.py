"""The ablation's scheduler: runs side by side, the cores shared out, a run that writes
no results is one error naming it, a run is pytest forked into a process group of its
own with the environment it was given (the pytest runs themselves: `make ablation`)."""

from __future__ import annotations

import os
import types

import pytest

from harness import HarnessError
from harness.suites import ablation


def test_two_runs_at_once_on_two_cores_each_with_one_worker(monkeypatch):
    monkeypatch.setattr(ablation.os, "cpu_count", lambda: 2)
    assert ablation._jobs(0, 20) == 2
    assert ablation._workers("auto", 2) == "1"
    assert ablation._jobs(0, 1) == 1 and ablation._workers("auto", 1) == "2"
    assert ablation._jobs(3, 20) == 3 and ablation._workers("4", 3) == "4"
    monkeypatch.setattr(ablation.os, "cpu_count", lambda: 1)
    assert ablation._jobs(0, 20) == 1


class _FakeRun:
    """Stands in for a pytest run: finishes after a few polls, records concurrency."""

    active = 0
    most = 0
    order: list[str] = []

    def __init__(self, lay, label, guards, tree, workers, extra):
        self.label, self.polls = label, 0
        _FakeRun.active += 1
        _FakeRun.most = max(_FakeRun.most, _FakeRun.active)
        _FakeRun.order.append(label)

    def poll(self):
        self.polls += 1
        return 0 if self.polls > 2 else None

    def finish(self):
        _FakeRun.active -= 1
        return {f"t::{self.label}": {"status": "passed", "reason": ""}}

    def kill(self):
        pass


def test_every_run_is_started_in_order_and_at_most_jobs_at_once(monkeypatch):
    monkeypatch.setattr(ablation, "_Run", _FakeRun)
    monkeypatch.setattr(ablation.time, "sleep", lambda s: None)
    runs = [(f"r{i}", [f"p{i}"], None) for i in range(5)]
    results = ablation._run_all(None, runs, 2, "1", [])
    assert sorted(results) == [f"r{i}" for i in range(5)]
    assert _FakeRun.order == [f"r{i}" for i in range(5)] and _FakeRun.most == 2


def test_a_run_without_results_is_one_line_naming_it(tmp_path):
    """pytest that dies before writing its junit: one error naming the run and its log."""
    lay = types.SimpleNamespace(results=tmp_path / "results", root=tmp_path,
                                rel=lambda p: str(p.relative_to(tmp_path)))
    run = ablation._Run.__new__(ablation._Run)
    run.lay, run.label = lay, "without-p1"
    run.junit = tmp_path / "none.xml"
    run.log = tmp_path / "without-p1.log"
    run.log.write_text("collecting ...\nImportError: no module named sglang\n\nexit\n")
    import os
    import time

    run.t0 = time.monotonic()
    run.rc = None
    run.pid = os.fork()
    if run.pid == 0:
        os._exit(4)
    with pytest.raises(HarnessError) as exc:
        run.finish()
    msg = str(exc.value)
    assert msg.startswith("ablation run without-p1 produced no results (pytest exit 4; without-p1.log)")
    assert msg.endswith("ImportError: no module named sglang") and len(msg.splitlines()) == 1


def test_a_run_is_pytest_in_a_process_group_of_its_own(tmp_path):
    """The child a run forks: its own process group (the parent's kill takes what it
    starts), the environment it was given (not this process's), its output in its log,
    pytest's status as its exit code."""
    (tmp_path / "test_probe.py").write_text(
        "import os\n"
        "def test_env():\n"
        "    assert os.environ.get('PROBE') == 'given' and 'PYTEST_CURRENT_TEST' in os.environ\n"
        "    assert os.getpgid(0) == os.getpid()\n"
        "def test_fails():\n"
        "    assert False, 'the probe fails'\n")
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != "PROBE"}
    pid = os.fork()
    if pid == 0:
        ablation._pytest_child(["-q", "-p", "no:cacheprovider", "test_probe.py"],
                               dict(env, PROBE="given"), log, tmp_path)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1  # pytest: tests failed
    text = log.read_text()
    assert "1 failed, 1 passed" in text and "the probe fails" in text
    assert "PROBE" not in os.environ


def test_two_patch_ids_after_one_patch_flag_is_one_line(monkeypatch):
    """`--patch A B`: B would go to pytest as a path and A be reported untested; the
    run stops first with one line that says how to ask for both."""
    monkeypatch.setattr(ablation, "layout", lambda: None)
    monkeypatch.setattr(ablation, "_patch_ids", lambda lay: [("0001-a.patch", "a"), ("0002-b.patch", "b")])
    args = types.SimpleNamespace(patch=["a"], passthrough=["b", "-k", "x"], jobs=0, workers="auto")
    with pytest.raises(HarnessError) as exc:
        ablation.run(args)
    assert str(exc.value) == "b: a Patch-Id given to pytest; give each its own --patch (--patch b)"


def _series_repo(tmp_path):
    """A pristine commit and three patches: P edits a.py, Q edits b.py alone, R edits the
    line P wrote (it needs P's lines)."""
    from harness.patchset.git import git

    repo = tmp_path / "tree"
    (repo / "python").mkdir(parents=True)
    git(repo, "init", "-q")
    commits = []
    for name, files in (("base", {"a.py": "x = 1\n", "b.py": "y = 1\n"}), ("P", {"a.py": "x = 2\n"}),
                        ("Q", {"b.py": "y = 2\n"}), ("R", {"a.py": "x = 3\n"})):
        for f, text in files.items():
            (repo / "python" / f).write_text(text)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", name)
        commits.append(git(repo, "rev-parse", "HEAD").stdout.strip())
    return repo, commits


def test_a_patch_is_left_out_alone_where_the_later_ones_apply_without_it(tmp_path):
    """Q left out alone: R still applies, and the tree has P and R but not Q; the work
    tree and its index are untouched and the scratch index is gone."""
    from harness.patchset.git import git, replay_tree

    repo, (base, p, q, r) = _series_repo(tmp_path)
    index = tmp_path / "scratch-index"
    tree, why = replay_tree(repo, p, [r], index)
    assert why == "" and tree is not None and not index.exists()
    assert git(repo, "show", f"{tree}:python/a.py").stdout == "x = 3\n"
    assert git(repo, "show", f"{tree}:python/b.py").stdout == "y = 1\n"
    assert git(repo, "status", "--porcelain").stdout == ""


def test_a_later_patch_that_needs_the_left_out_one_is_named_with_its_file(tmp_path):
    """P left out: Q applies, R does not (it edits P's line); the reason names R and the
    file, for the report; the ablation then cuts P and every later patch."""
    from harness.patchset.git import replay_tree

    repo, (base, p, q, r) = _series_repo(tmp_path)
    tree, why = replay_tree(repo, base, [q, r], tmp_path / "scratch-index")
    assert tree is None
    assert why.startswith("'R' does not apply without it") and "python/a.py" in why


def test_a_failure_is_on_import_where_it_stops_at_a_missing_name():
    assert ablation.failure_kind("error", "ImportError: cannot import name 'X' from 'sglang.srt'") == "import"
    assert ablation.failure_kind("failed", "AttributeError: 'M' object has no attribute 'set_x'") == "import"
    assert ablation.failure_kind("failed", "AssertionError: rank 0: capture 2 differs") == "behaviour"
    assert ablation.failure_kind("failed", "RuntimeError: captured 2 of 3 aux hidden states") == "behaviour"
    assert ablation.failure_kind("passed", "") == ""
