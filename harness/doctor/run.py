"""``doctor``: which features a draft was trained on, and whether this server feeds them.

    python -m harness doctor --target DIR --draft DIR [--features PATH] [server flags]
    make doctor TARGET=DIR DRAFT=DIR [FEATURES=PATH] [BASE=0.5.23] [ARGS='...']

Prints a table (one row per slot: what this server feeds, what pristine SGLang of the
base and vLLM would feed, what the features hold, the verdict) and writes the report
as JSON (``--json``, default ``build/doctor/report.json``; ``build/doctor-<base>/`` for
another base). Exit status 0 when every slot matches (or, without features, nothing
the draft declares contradicts itself), 1 on a mismatch or a bad input (one line, and
nothing written).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import HarnessError, progress

ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, type=Path, help="the target checkpoint directory")
    p.add_argument("--draft", required=True, type=Path, help="the draft checkpoint directory")
    p.add_argument("--features", type=Path, default=None,
                   help="the draft's training features: a SpecForge torch file or safetensors file "
                        "(input_ids, aux_hidden_state[, hidden_state]), or a directory of them")
    p.add_argument("--speculative-algorithm", choices=ALGORITHMS, default=None,
                   help="the server's algorithm (default: what the draft config says)")
    p.add_argument("--speculative-final-layer-capture", default=None, metavar="VALUE",
                   help="the server flag, as the server would be started with it (pre_norm / post_norm)")
    p.add_argument("--speculative-deepstack-capture", default=None, metavar="VALUE",
                   help="the server flag (pre_deepstack / post_deepstack)")
    p.add_argument("--json", type=Path, default=None, help="where to write the report")
    p.add_argument("--no-verify", action="store_true", help="do not serve the proposed fix to check it")
    p.add_argument("--max-files", type=int, default=4, help="features files read from a directory")
    p.add_argument("--max-tokens", type=int, default=512, help="rows read per text-only features file")
    p.add_argument("--reference-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the dtype transformers runs the target in against the features")


def report_path(explicit: Path | None) -> Path:
    from harness.patchset.layout import layout

    return explicit if explicit is not None else layout().doctor / "report.json"


def run(args: argparse.Namespace) -> int:
    from harness.doctor import diagnose, render
    from harness.patchset.layout import layout
    from harness.patchset.scratch import scratch
    from harness.ranks import RankError, close_all_pools

    from harness.doctor import declared, features, target

    lay = layout()
    for what, path in (("target", args.target), ("draft", args.draft)):
        if not path.is_dir():
            raise HarnessError(f"doctor: {what} {path}: not a directory")
    # Every input is read and checked before anything starts or is written.
    tgt = target.read(args.target, lay.label)
    declared.read(args.draft, args.speculative_algorithm, lay.label)
    if args.features is not None:
        features.load(args.features, tgt.hidden, args.max_files, args.max_tokens)
    options = diagnose.Options(
        algorithm=args.speculative_algorithm, final_layer_capture=args.speculative_final_layer_capture,
        deepstack_capture=args.speculative_deepstack_capture, verify=not args.no_verify,
        max_files=args.max_files, max_tokens=args.max_tokens, reference_dtype=args.reference_dtype)
    out = report_path(args.json)
    lay.build.mkdir(parents=True, exist_ok=True)
    with scratch(lay.build, "doctor") as work:
        try:
            pool = diagnose.open_pool()
            report = diagnose.diagnose(args.target, args.draft, args.features, options, pool,
                                       diagnose.Shrunk(work), lay.label)
        except RankError as exc:
            raise HarnessError(f"doctor: SGLang's rank failed: {str(exc).splitlines()[0]}") from None
        finally:
            close_all_pools()
    print(render.table(report), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    progress(f"doctor: wrote {out}")
    return 0 if report.verdict in ("match", "unverified") else 1
