"""``ablation``: every regression test must fail without its patch and pass with it.

For each patch P of the series (by its ``Patch-Id`` trailer), the tests marked
``@pytest.mark.guards("P")`` run against the SGLang tree with P and every patch
after it left out (the tree at the commit just before P in build/sglang), then
against the full series (the installed patched wheel). The run fails when a test
passes without its patch, fails with it, or when a patch has no regression test.

Results: a table on stdout, build/results/ablation.json and ablation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from harness import HarnessError
from harness.patchset.git import git
from harness.patchset.layout import layout
from harness.patchset.series import patch_message, read_series


# Arguments this verb does not know go to pytest, in order (`make test ARGS='-k comm'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patch", action="append", default=[], metavar="PATCH_ID",
                   help="only these patches (default: all)")
    p.add_argument("-n", "--workers", default="auto", help="pytest-xdist workers (default auto)")


def _patch_ids(lay) -> list[tuple[str, str]]:
    out = []
    for name in read_series(lay):
        _, _, trailers = patch_message((lay.patches / name).read_text())
        pid = trailers.get("Patch-Id")
        if not pid:
            raise HarnessError(f"{name}: no Patch-Id trailer")
        out.append((name, pid))
    return out


def _variant_tree(lay, index: int, pid: str) -> Path:
    """The tree with patches [index:] left out, as a plain source dir."""
    tree = lay.tree
    if not (tree / ".git").exists():
        raise HarnessError(f"{lay.rel(tree)} is missing: run `make apply-patches` first")
    commits = git(tree, "rev-list", "--reverse", "--first-parent", "HEAD").stdout.split()
    # commits[0] is the pristine pin; commits[i] has patches 1..i
    if len(commits) < index + 1:
        raise HarnessError(f"{lay.rel(tree)} has {len(commits) - 1} patch commits; run `make apply-patches`")
    commit = commits[index]
    dest = lay.ablation / f"without-{pid}"
    stamp = dest / ".commit"
    if stamp.exists() and stamp.read_text() == commit:
        return dest / "python"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(tree), "archive", commit, "python"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    stamp.write_text(commit)
    return dest / "python"


def _run_pytest(lay, label: str, guards: list[str], sglang_path: Path | None,
                workers: str, extra: list[str]) -> dict[str, dict[str, str]]:
    results_dir = lay.results / "ablation"
    results_dir.mkdir(parents=True, exist_ok=True)
    junit = results_dir / f"{label}.xml"
    if junit.exists():
        junit.unlink()
    env = dict(os.environ)
    env.pop("HARNESS_SGLANG_PATH", None)
    if sglang_path is not None:
        env["HARNESS_SGLANG_PATH"] = str(sglang_path)
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", workers, "--dist", "loadgroup",
           "-q", "--tb=line", "--junitxml", str(junit), "--e2e", "tests"]
    for g in guards:
        cmd += ["--guards", g]
    cmd += extra
    where = "installed patched build" if sglang_path is None else lay.rel(sglang_path)
    print(f"[ablation] {label}: {' '.join('--guards ' + g for g in guards)} on {where}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=lay.root, env=env, capture_output=True, text=True)
    print(f"[ablation] {label}: pytest exit {proc.returncode} in {time.monotonic() - t0:.0f}s",
          flush=True)
    if not junit.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise HarnessError(f"ablation run {label} produced no results (pytest exit {proc.returncode}): {tail}")
    return _parse_junit(junit)


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
    wanted = set(args.patch) or {pid for _, pid in patches}
    unknown = wanted - {pid for _, pid in patches}
    if unknown:
        raise HarnessError(f"unknown Patch-Id(s): {', '.join(sorted(unknown))}")
    rows: list[dict[str, Any]] = []
    without: dict[str, dict[str, dict[str, str]]] = {}
    for index, (name, pid) in enumerate(patches):
        if pid not in wanted:
            continue
        tree = _variant_tree(lay, index, pid)
        without[pid] = _run_pytest(lay, f"without-{pid}", [pid], tree, args.workers, extra)
    with_all = _run_pytest(lay, "full-series", sorted(wanted), None, args.workers, extra)

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
                "test": test, "patch": pid, "without": res["status"], "without_reason": res["reason"],
                "with": full["status"], "with_reason": full["reason"], "ok": good,
            })
            if not good:
                if res["status"] == "passed":
                    problems.append(f"{test}: passes without patch {pid}")
                elif full["status"] != "passed":
                    problems.append(f"{test}: {full['status']} with the full series: {full['reason']}")
                else:
                    problems.append(f"{test}: {res['status']} without patch {pid}")

    _write_report(lay, rows, problems, ok)
    if not ok:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        raise HarnessError(f"ablation failed: {len(problems)} problem(s); see build/results/ablation.md")
    print(f"[ablation] ok: {len(rows)} regression tests fail without their patch and pass with it")
    return 0


def _write_report(lay, rows: list[dict[str, Any]], problems: list[str], ok: bool) -> None:
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    (results / "ablation.json").write_text(json.dumps(
        {"ok": ok, "rows": rows, "problems": problems}, indent=2) + "\n")
    lines = ["| test | patch | without patch | with series | ok |", "|---|---|---|---|---|"]
    for r in rows:
        why = f" ({r['without_reason']})" if r["without_reason"] else ""
        lines.append(f"| `{r['test']}` | {r['patch']} | {r['without']}{why} | {r['with']} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    summary = {}
    for r in rows:
        s = summary.setdefault(r["patch"], [0, 0])
        s[0] += 1
        s[1] += int(r["ok"])
    lines += ["", "| patch | regression tests | fail without, pass with |", "|---|---|---|"]
    for pid, (n, good) in summary.items():
        lines.append(f"| {pid} | {n} | {good} |")
    md = "\n".join(lines) + "\n"
    (results / "ablation.md").write_text(md)
    print(md)
