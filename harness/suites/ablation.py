"""``ablation``: every regression test must fail without its patch and pass with it.

For each patch P of the series (by its ``Patch-Id`` trailer), the tests marked
``@pytest.mark.guards("P")`` run against the SGLang tree without P, then against the
full series (the installed patched wheel). Without P means P alone left out, every
other patch applied, where each later patch still applies exactly without it; where
one does not, P and every patch after it (the tree at the commit just before P in
build/sglang), and the report says which later patch needs P's lines, in which file.
The run fails when a test passes without its patch, fails with it, or when a patch has
no regression test. Each failure without the patch is reported as one on behaviour (a
value, an error of the code under test) or on import (a name the tree lacks: the test
stopped at the API), with both counts.

The runs are independent (each its own pytest process on its own tree), so they go
two at a time on two cores or more (``--jobs``), each with the cores shared out
(``--workers``): a run's fixed cost (collection, its rank pools importing SGLang from
its tree) then overlaps another run's tests. The full series goes first, the longest
run. Each run forks from this process after it has imported the third-party packages
SGLang pulls in (``harness.zygote.preload``: torch, transformers, flashinfer, ...), never
SGLang itself, and runs pytest in-process with one worker (``-n 0``), so a run imports
only SGLang from its own tree, not its dependencies again. Each run's output is in
build/results/ablation/<run>.log.

Results: a table on stdout, build/results/ablation.json and ablation.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from harness import HarnessError
from harness.patchset.git import export_commit, git, replay_tree
from harness.patchset.layout import layout
from harness.patchset.series import patch_message, read_series


# Arguments this verb does not know go to pytest, in order (`make test ARGS='-k comm'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patch", action="append", default=[], metavar="PATCH_ID",
                   help="only these patches (default: all)")
    p.add_argument("-n", "--workers", default="auto",
                   help="pytest-xdist workers per run (default: the cores over --jobs, at least 1; "
                        "1 runs the tests in the run's own process)")
    p.add_argument("-j", "--jobs", type=int, default=0,
                   help="pytest runs at once, each on its own tree (default: 2 on 2 cores or "
                        "more, else 1)")


def _jobs(requested: int, runs: int) -> int:
    """Runs side by side: each run's fixed cost (collection, its workers and rank pools
    importing SGLang from its own tree) overlaps another run's tests."""
    cores = os.cpu_count() or 1
    jobs = requested or (2 if cores >= 2 else 1)
    return max(1, min(jobs, runs))


def _workers(requested: str, jobs: int) -> str:
    if requested != "auto":
        return requested
    return str(max(1, (os.cpu_count() or 1) // jobs))


def _patch_ids(lay) -> list[tuple[str, str]]:
    out = []
    for name in read_series(lay):
        _, _, trailers = patch_message((lay.patches / name).read_text())
        pid = trailers.get("Patch-Id")
        if not pid:
            raise HarnessError(f"{name}: no Patch-Id trailer")
        out.append((name, pid))
    return out


def _variant_tree(lay, index: int, pid: str) -> tuple[Path, str]:
    """The tree without patch ``index`` (0-based in the series), as a plain source dir,
    and how it was cut. Only that patch is left out where every later patch still
    applies without it, exactly (``replay_tree``); otherwise the patch and every patch
    after it (the tree at the commit just before it), with the reason: the later patch
    that needs its lines, and the file."""
    tree = lay.tree
    if not (tree / ".git").exists():
        raise HarnessError(f"{lay.rel(tree)} is missing: run `make apply-patches` first")
    commits = git(tree, "rev-list", "--reverse", "--first-parent", "HEAD").stdout.split()
    # commits[0] is the pristine pin; commits[i] has patches 1..i
    if len(commits) < index + 2:
        raise HarnessError(f"{lay.rel(tree)} has {len(commits) - 1} patch commits; run `make apply-patches`")
    later = commits[index + 2:]
    dest = lay.ablation / f"without-{pid}"
    if later:
        lay.ablation.mkdir(parents=True, exist_ok=True)
        treeish, why = replay_tree(tree, commits[index], later, lay.ablation / f".index-{pid}")
        if treeish is not None:
            return export_commit(tree, treeish, "python", dest) / "python", "alone"
        cut = f"with the {len(later)} patch(es) after it: {why}"
    else:
        cut = "alone (the last patch)"
    return export_commit(tree, commits[index], "python", dest) / "python", cut


# A failure that stops at SGLang's API (a name the tree without the patch lacks) rather
# than at a value: the test could not reach the behaviour it guards.
_IMPORT_FAILURES = ("ImportError", "ModuleNotFoundError", "cannot import name",
                    "has no attribute", "unexpected keyword argument")


def failure_kind(status: str, reason: str) -> str:
    """``import`` where a failed test stopped at a missing name, ``behaviour`` where it
    got to a value or an error of the code under test; "" where it did not fail."""
    if status not in ("failed", "error"):
        return ""
    return "import" if any(m in reason for m in _IMPORT_FAILURES) else "behaviour"


class _Run:
    """One pytest run of the ablation, forked from this process (its output goes to
    ``<label>.log`` next to its junit file)."""

    def __init__(self, lay, label: str, guards: list[str], sglang_path: Path | None,
                 workers: str, extra: list[str]) -> None:
        results_dir = lay.results / "ablation"
        results_dir.mkdir(parents=True, exist_ok=True)
        self.lay, self.label = lay, label
        self.junit = results_dir / f"{label}.xml"
        self.log = results_dir / f"{label}.log"
        if self.junit.exists():
            self.junit.unlink()
        env = dict(os.environ)
        env.pop("HARNESS_SGLANG_PATH", None)
        if sglang_path is not None:
            env["HARNESS_SGLANG_PATH"] = str(sglang_path)
        # One worker: the run's own process (it inherits the preloaded packages).
        args = ["-p", "xdist", "-n", "0" if workers == "1" else workers, "--dist", "loadgroup",
                "-q", "--tb=line", "--junitxml", str(self.junit), "--e2e", "tests"]
        for g in guards:
            args += ["--guards", g]
        args += extra
        where = "installed patched build" if sglang_path is None else lay.rel(sglang_path)
        print(f"[ablation] {label}: {' '.join('--guards ' + g for g in guards)} on {where} "
              f"({workers} worker(s))", flush=True)
        sys.stderr.flush()
        self.t0 = time.monotonic()
        self.rc: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            _pytest_child(args, env, self.log, lay.root)

    def poll(self) -> int | None:
        if self.rc is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.rc = os.waitstatus_to_exitcode(status)
                self._sweep()
        return self.rc

    def finish(self) -> dict[str, dict[str, str]]:
        if self.rc is None:
            _, status = os.waitpid(self.pid, 0)
            self.rc = os.waitstatus_to_exitcode(status)
            self._sweep()
        rc = self.rc
        print(f"[ablation] {self.label}: pytest exit {rc} in {time.monotonic() - self.t0:.0f}s",
              flush=True)
        if not self.junit.exists():
            lines = [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
            why = next((x for x in reversed(lines) if "Error" in x), lines[-1] if lines else "no output")
            raise HarnessError(f"ablation run {self.label} produced no results (pytest exit {rc}; "
                               f"{self.lay.rel(self.log)}): {why}")
        return _parse_junit(self.junit)

    def _sweep(self) -> None:
        """Whatever the run left in its process group (it leads one)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        if self.rc is None:
            self._sweep()
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.rc = -signal.SIGKILL


def _pytest_child(args: list[str], env: dict[str, str], log: Path, root: Path) -> None:
    """In a forked child: its own process group and session (the parent's kill takes its
    descendants that stay in it), stdin from /dev/null, stdout and stderr (descriptors
    too) to ``log``, ``env`` as its environment, ``pytest.main(args)`` in ``root``; then
    the exit handlers the run registered (its rank pools' and engines' closes), not the
    parent's; exits with pytest's status."""
    rc = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        atexit._clear()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # Python's streams onto them too (a parent's may be replaced, as under pytest).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(root)
        import pytest

        rc = int(pytest.main(args))
        atexit._run_exitfuncs()
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the run's log, then exit
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _run_all(lay, runs: list[tuple[str, list[str], Path | None]], jobs: int, workers: str,
             extra: list[str]) -> dict[str, dict[str, dict[str, str]]]:
    """Every run, ``jobs`` at a time, in the order given (the longest first balances
    the slots); returns their results by label."""
    pending = list(runs)
    active: list[_Run] = []
    results: dict[str, dict[str, dict[str, str]]] = {}
    try:
        while pending or active:
            while pending and len(active) < jobs:
                label, guards, tree = pending.pop(0)
                active.append(_Run(lay, label, guards, tree, workers, extra))
            done = next((r for r in active if r.poll() is not None), None)
            if done is None:
                time.sleep(0.5)
                continue
            active.remove(done)
            results[done.label] = done.finish()
    finally:
        for r in active:
            r.kill()
    return results


def _parse_junit(path: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed" if child.tag == "failure" else "error"
                reason = (child.get("message") or child.text or "").strip().splitlines()
                reason = reason[0] if reason else ""
                break
            if child.tag == "skipped":
                status, reason = "skipped", (child.get("message") or "")
        out[name] = {"status": status, "reason": reason[:160]}
    return out


def run(args: argparse.Namespace) -> int:
    lay = layout()
    extra = args.passthrough
    patches = _patch_ids(lay)
    known = {pid for _, pid in patches}
    wanted = set(args.patch) or known
    unknown = wanted - known
    if unknown:
        raise HarnessError(f"unknown Patch-Id(s): {', '.join(sorted(unknown))}")
    # `--patch A B` takes A alone; B would go to pytest as a path it cannot find and the
    # run would report A untested. Say so instead.
    stray = [x for x in extra if x in known]
    if stray:
        raise HarnessError(f"{', '.join(stray)}: a Patch-Id given to pytest; "
                           f"give each its own --patch (--patch {' --patch '.join(stray)})")
    rows: list[dict[str, Any]] = []
    # The full series first: it runs every guarded test, the longest run by far.
    runs: list[tuple[str, list[str], Path | None]] = [("full-series", sorted(wanted), None)]
    cuts: dict[str, str] = {}
    for index, (name, pid) in enumerate(patches):
        if pid in wanted:
            path, cuts[pid] = _variant_tree(lay, index, pid)
            print(f"[ablation] without-{pid}: {pid} left out {cuts[pid]}", flush=True)
            runs.append((f"without-{pid}", [pid], path))
    jobs = _jobs(args.jobs, len(runs))
    from harness.zygote import preload

    preload()  # once, here: every run forks with them imported
    results = _run_all(lay, runs, jobs, _workers(args.workers, jobs), extra)
    with_all = results["full-series"]
    without = {pid: results[f"without-{pid}"] for _, pid in patches if pid in wanted}

    ok = True
    problems: list[str] = []
    for name, pid in patches:
        if pid not in wanted:
            continue
        tests = without[pid]
        if not tests:
            problems.append(f"{name}: no regression test is marked guards({pid!r})")
            ok = False
        for test, res in sorted(tests.items()):
            full = with_all.get(test, {"status": "missing", "reason": "not run with the full series"})
            good = res["status"] in ("failed", "error") and full["status"] == "passed"
            ok &= good
            rows.append({
                "test": test, "patch": pid, "cut": cuts[pid], "without": res["status"],
                "without_reason": res["reason"], "failed_on": failure_kind(res["status"], res["reason"]),
                "with": full["status"], "with_reason": full["reason"], "ok": good,
            })
            if not good:
                if res["status"] == "passed":
                    problems.append(f"{test}: passes without patch {pid}")
                elif full["status"] != "passed":
                    problems.append(f"{test}: {full['status']} with the full series: {full['reason']}")
                else:
                    problems.append(f"{test}: {res['status']} without patch {pid}")

    _write_report(lay, rows, problems, ok, cuts)
    if not ok:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        raise HarnessError(f"ablation failed: {len(problems)} problem(s); see build/results/ablation.md")
    print(f"[ablation] ok: {len(rows)} regression tests fail without their patch and pass with it")
    return 0


def _write_report(lay, rows: list[dict[str, Any]], problems: list[str], ok: bool,
                  cuts: dict[str, str]) -> None:
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    kinds = {k: sum(r["failed_on"] == k for r in rows) for k in ("behaviour", "import")}
    (results / "ablation.json").write_text(json.dumps(
        {"ok": ok, "failed_on": kinds, "cuts": cuts, "rows": rows, "problems": problems},
        indent=2) + "\n")
    lines = ["| test | patch | without patch | failed on | with series | ok |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        why = f" ({r['without_reason']})" if r["without_reason"] else ""
        lines.append(f"| `{r['test']}` | {r['patch']} | {r['without']}{why} | {r['failed_on'] or '-'} | "
                     f"{r['with']} | {'yes' if r['ok'] else 'NO'} |")
    summary: dict[str, list[int]] = {}
    for r in rows:
        s = summary.setdefault(r["patch"], [0, 0, 0, 0])
        s[0] += 1
        s[1] += int(r["ok"])
        s[2] += int(r["failed_on"] == "behaviour")
        s[3] += int(r["failed_on"] == "import")
    lines += ["", "| patch | left out | regression tests | fail without, pass with | on behaviour | "
              "on import |", "|---|---|---|---|---|---|"]
    for pid, (n, good, beh, imp) in summary.items():
        lines.append(f"| {pid} | {cuts.get(pid, '')} | {n} | {good} | {beh} | {imp} |")
    lines += ["", f"Failed on behaviour: {kinds['behaviour']}; on import (a name the tree "
              f"without the patch lacks): {kinds['import']}."]
    md = "\n".join(lines) + "\n"
    (results / "ablation.md").write_text(md)
    print(md)
