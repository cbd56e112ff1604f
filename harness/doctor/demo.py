"""``doctor-demo``: the doctor on tiny checkpoints with planted conventions.

    make doctor-demo [BASE=0.5.23] [ARGS='--case NAME ... | --no-engine']

For every case of :mod:`harness.doctor.cases` on the active base, builds a tiny target
(the parity family's, 6 layers), a draft, and features made by a trainer-shaped path
(transformers' ``output_hidden_states`` under transformers 5's rules or 4.57's emulated
in-place deepstack; on 0.5.23 also this project's patched Engine with
``--enable-return-aux-hidden-states``), runs the doctor on them, and writes
``build/doctor/demo.json`` (``build/doctor-<base>/``): one entry per case,
``{"case", "family", "planted", "detected", "verdict", "fix", ...}``. The checkpoints
stay in ``build/doctor/demo/<case>/`` for ``make doctor`` by hand. Exit status 1 when
the doctor misses a planted convention, gives another verdict than the case expects, or
names no (verified) fix for a mismatch.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from harness import HarnessError, progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--case", action="append", default=[], metavar="NAME", help="only these cases")
    p.add_argument("--no-engine", action="store_true",
                   help="leave out the cases whose features come from SGLang's Engine (0.5.23)")
    p.add_argument("--json", type=Path, default=None, help="where to write the summary")
    p.add_argument("--verbose", action="store_true", help="print each case's full report")


def build(case, root: Path, targets: dict, session=None) -> tuple[Path, Path, Path]:
    """(target, draft, features) of ``case`` under ``root`` (a target per family, shared)."""
    from harness.doctor import cases

    if case.family not in targets:
        directory = root / "targets" / case.family
        targets[case.family] = (directory, cases.make_target(case.family, directory))
    target_dir, model = targets[case.family]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    draft = cases.make_draft(case, root / case.name / "draft", int(text.hidden_size), int(text.num_hidden_layers))
    suffix = ".safetensors" if case.fmt == "safetensors" else ".pt"
    features = cases.plant(case, target_dir, model, draft, root / case.name / f"features{suffix}", session)
    return target_dir, draft, features


def run(args: argparse.Namespace) -> int:
    from harness.doctor import cases, diagnose, render
    from harness.patchset.layout import layout
    from harness.ranks import close_all_pools

    lay = layout()
    base = lay.label
    sources = ("transformers",) if args.no_engine else ("transformers", "engine")
    selected = cases.cases(base, sources)
    if args.case:
        unknown = sorted(set(args.case) - {c.name for c in cases.CASES})
        if unknown:
            raise HarnessError(f"doctor-demo: unknown case(s) {', '.join(unknown)} "
                               f"(cases: {', '.join(c.name for c in cases.CASES)})")
        selected = [c for c in selected if c.name in args.case]
    root = lay.doctor / "demo"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    session = None
    if any(c.source == "engine" for c in selected):
        from harness.e2e.engine import Session

        session = Session(root / "engine", base=base)
    entries, targets = [], {}
    try:
        pool = diagnose.open_pool()
        shrunk = diagnose.Shrunk(root / "work")
        for case in selected:
            progress(f"doctor-demo: {case.name} ({case.source} features, planted {case.planted})")
            target_dir, draft, features = build(case, root, targets, session)
            report = diagnose.diagnose(target_dir, draft, features, diagnose.Options(quiet=True), pool,
                                       shrunk, base)
            if args.verbose:
                print(render.table(report), flush=True)
            entries.append(cases.summary(case, report, base))
    finally:
        close_all_pools()
        if session is not None:
            session.close()
    out = args.json or lay.doctor / "demo.json"
    cases.dump(entries, out)
    rows = [["case", "planted", "detected", "verdict", "ok"]]
    for e in entries:
        shown = {k: e["detected"].get(k) for k in e["planted"]}
        rows.append([e["case"], _kv(e["planted"]), _kv(shown), e["verdict"], "ok" if e["ok"] else "WRONG"])
    print("\n".join(render._grid(rows)), flush=True)
    for e in entries:
        for fix in e["fix"]:
            print(f"{e['case']}: fix: {fix}", flush=True)
        for problem in e["problems"]:
            print(f"{e['case']}: WRONG: {problem}", flush=True)
    progress(f"doctor-demo: wrote {out} ({sum(e['ok'] for e in entries)} of {len(entries)} cases right)")
    return 0 if all(e["ok"] for e in entries) else 1


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())
