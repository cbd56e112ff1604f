"""pr-export's test runner (harness.zygote): each run is ``python3 <test>`` in
its tree, side by side, with its status, its output in its log, and a deadline."""

from __future__ import annotations

from harness.zygote import TIMED_OUT, Zygote


def _tree(tmp_path, name, body, package_body="VALUE = 1\n"):
    tree = tmp_path / name
    (tree / "python" / "pkg_under_test").mkdir(parents=True)
    (tree / "python" / "pkg_under_test" / "__init__.py").write_text(package_body)
    (tree / "t.py").write_text(body)
    return tree


def test_runs_take_their_tree_and_report_status_and_output(tmp_path):
    check = ("import sys, pkg_under_test\n"
             "print('value', pkg_under_test.VALUE)\n"
             "sys.exit(0 if pkg_under_test.VALUE == 2 else 3)\n")
    ok = _tree(tmp_path, "ok", check, "VALUE = 2\n")
    bad = _tree(tmp_path, "bad", check)
    raises = _tree(tmp_path, "raises", "raise ValueError('boom')\n")
    main = _tree(tmp_path, "main", "assert __name__ == '__main__'\n")
    z = Zygote(timeout=60, preload=())
    try:
        logs = [tmp_path / f"{t.name}.log" for t in (ok, bad, raises, main)]
        statuses = z.run([(t, "t.py", log) for t, log in zip((ok, bad, raises, main), logs)])
        assert statuses == [0, 3, 1, 0]
        assert "value 2" in logs[0].read_text() and "value 1" in logs[1].read_text()
        assert "ValueError: boom" in logs[2].read_text()
        # the zygote serves the next batch; a tree's package is not left behind
        assert z.run([(bad, "t.py", logs[1])]) == [3]
    finally:
        z.close()


def test_a_run_past_the_deadline_is_killed(tmp_path):
    slow = _tree(tmp_path, "slow", "import time\ntime.sleep(60)\n")
    z = Zygote(timeout=1, preload=())
    try:
        assert z.run([(slow, "t.py", tmp_path / "slow.log")]) == [TIMED_OUT]
    finally:
        z.close()
