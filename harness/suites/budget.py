"""``bench-suite``: the suites' time budget, measured (a benchmark, not a test).

Runs the CPU suites exactly as ``make test`` does (``python -m harness test``) and, with
``--ablation``, ``python -m harness ablation``, each with ``$HARNESS_IMPORT_LOG`` set, so
every process that brings SGLang up records one line (harness.ranks.sglang). Reports the
wall time of each, the number of processes that imported SGLang (pytest workers, ranks by
world size, per ablation tree) and their import time, beside the budget (on 2 cores:
``make test`` <= 8 min, ``make ablation`` <= 20 min). No thresholds: these machines are
noisy. Writes build/results/bench/suite.json and suite.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from harness import progress
from harness.patchset.layout import layout

BUDGET_S = {"test": 8 * 60, "ablation": 20 * 60}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ablation", action="store_true", help="also time `ablation` (about 15 min)")
    p.add_argument("--no-test", action="store_true", help="skip the `test` run")


def _run(verb: str, log: Path) -> dict:
    log.unlink(missing_ok=True)
    env = dict(os.environ, HARNESS_IMPORT_LOG=str(log))
    progress(f"[bench-suite] python -m harness {verb}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", verb], env=env, cwd=layout().root)
    wall = time.monotonic() - t0
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    imports = [x for x in lines if x["imported_sglang"]]
    roles = Counter(
        "rank-pool forkserver" if x["rank"] < 0
        else "in-process (TP=1)" if x["world_size"] == 1
        else f"rank of a {x['world_size']}-rank pool"
        for x in imports
    )
    trees = Counter(x["sglang_path"] or "installed patched build" for x in imports)
    per_pid = Counter(x["pid"] for x in imports)
    return {
        "verb": verb,
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "budget_s": BUDGET_S[verb],
        "sglang_imports": len(imports),
        "import_s_total": round(sum(x["seconds"] for x in imports), 1),
        "by_role": dict(roles),
        "by_tree": dict(trees),
        "max_imports_per_process": max(per_pid.values()) if per_pid else 0,
    }


def run(args: argparse.Namespace) -> int:
    lay = layout()
    out = lay.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.no_test:
        rows.append(_run("test", out / "imports-test.jsonl"))
    if args.ablation:
        rows.append(_run("ablation", out / "imports-ablation.jsonl"))
    (out / "suite.json").write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    lines = [
        f"Suite time budget, {os.cpu_count()} cores (benchmark, no thresholds).",
        "",
        "| verb | exit | wall | budget | processes that imported SGLang | import time (sum) | imports per process |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['verb']} | {r['exit']} | {r['wall_s'] / 60:.1f} min | {r['budget_s'] / 60:.0f} min | "
            f"{r['sglang_imports']} ({', '.join(f'{v} {k}' for k, v in sorted(r['by_role'].items()))}) | "
            f"{r['import_s_total']:.0f} s | {r['max_imports_per_process']} |"
        )
    md = "\n".join(lines) + "\n"
    (out / "suite.md").write_text(md)
    print(md)
    return max((r["exit"] for r in rows), default=0)
