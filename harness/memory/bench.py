"""``bench``: memory benchmark of the aux-capture path, list + cat against the packer.

Measured side by side in one run, per token count: peak bytes of each path over
baseline (exact live-storage bytes on CPU, the CUDA allocator's peak on GPU), the
ratio packer / list, and the bytes copied per forward (clone + copy_ + cat).
Writes build/results/bench/memory.json and memory.md. Not a test: no thresholds.

``--engine`` runs the capture-cost benchmark in SGLang's real Engine instead
(``harness.e2e.bench``: pristine base vs series vs no capture, BASE=0.5.23).
"""

from __future__ import annotations

import argparse
import json
import time

from harness import HarnessError
from harness.patchset.layout import layout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--family", default="llama",
                   help="list-capturing model family measured before (pin) and after (series) "
                        "as a whole model (default llama; '' skips)")
    p.add_argument("--model-hidden", type=int, default=1024,
                   help="hidden size of that tiny model (default 1024)")
    p.add_argument("--models", nargs="+", metavar="SPEC",
                   help="instead: these stand-in specs (harness.standins.models), each a tiny real "
                        "model of the pristine base and of the series side by side, at --tokens, "
                        "K=--k, --dtype, the spec's own width (as the memory tier runs them)")
    p.add_argument("--pp", action="store_true",
                   help="instead: kimi_k3 over two pipeline stages, pristine 0.5.23 against the "
                        "series, at --tokens x --hidden (BASE=0.5.23; harness.memory.pipeline)")
    from harness.e2e import bench as engine_bench

    engine_bench.add_arguments(p)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _model_rows(args: argparse.Namespace, device: str) -> list:
    from harness.memory.models import model_capture_peaks

    rows = []
    layers = [2, 4, 5][: args.k] if args.k <= 3 else list(range(1, args.k + 1))
    for tokens in args.tokens:
        r = model_capture_peaks(args.family, tokens, args.model_hidden, layers, args.dtype, device)
        rows.append(r)
        print(f"[bench] {args.family} T={tokens}: capture path pin {_mib(r['pin']['capture_path_peak_bytes'])} "
              f"MiB, series {_mib(r['patched']['capture_path_peak_bytes'])} MiB", flush=True)
    return rows


def _run_pp(args: argparse.Namespace) -> int:
    """kimi_k3's two pipeline stages (the first packs K1 captures, the last K),
    pristine 0.5.23 against the series: exact live bytes on CPU, one row per stage and
    token count. Writes build/results/bench/memory-pp.json and memory-pp.md."""
    from harness.memory.pipeline import kimi_k3_pp_peaks
    from harness.patchset.pin import load_pin
    from harness.ranks.sglang import init_sglang_distributed

    if load_pin(layout())["version"] != "0.5.23":
        raise HarnessError("bench --pp measures 0.5.23's kimi_k3: run it with BASE=0.5.23")
    init_sglang_distributed(rank=0, world_size=1)
    rows = [kimi_k3_pp_peaks(tokens, args.hidden, args.dtype) for tokens in args.tokens]
    out = layout().results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory-pp.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    lines = [
        f"kimi_k3 over two pipeline stages (real KimiK3LinearModel.forward, whole-layer "
        f"stand-ins; K1={rows[0]['k1']} capture on the first stage, K={rows[0]['k']} on the "
        f"last), H={args.hidden}, {args.dtype}, cpu (live storage, exact), pristine 0.5.23 "
        "against the series, one process. MiB over baseline.",
        "",
        "| T | one capture | stage | pristine | series | series/pristine |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    names = {"first_stage_forward": "first: its forward",
             "last_stage_capture_path": "last: captures handed over + pack",
             "last_stage_forward_and_pack": "last: its forward + pack"}
    for r in rows:
        for key, name in names.items():
            a, b = r["pin"][key], r["patched"][key]
            lines.append(f"| {r['tokens']} | {_mib(r['capture_bytes'])} | {name} | {_mib(a)} | "
                         f"{_mib(b)} | {b / a:.3f} |")
    md = "\n".join(lines) + "\n"
    (out / "memory-pp.md").write_text(md)
    print(md)
    print(f"[bench] wrote {layout().rel(out / 'memory-pp.json')} and memory-pp.md")
    return 0


def _run_models(args: argparse.Namespace) -> int:
    """Each named model (a stand-in spec), pristine base against the series, one
    process: the capture path's exact peak (the captures the forward hands over plus
    what packing them adds) per token count. Writes memory-models.{json,md}."""
    import torch

    from harness.memory.models import model_capture_peaks
    from harness.ranks.sglang import init_sglang_distributed
    from harness.standins.models import specs

    unknown = [m for m in args.models if m not in specs()]
    if unknown:
        raise HarnessError(f"bench --models: no stand-in spec {', '.join(unknown)} on this base")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    init_sglang_distributed(rank=0, world_size=1)
    layers = [2, 4, 5][: args.k] if args.k <= 3 else list(range(1, args.k + 1))
    rows = []
    for name in args.models:
        for tokens in args.tokens:
            r = model_capture_peaks(name, tokens, specs()[name].tiny.hidden_size, layers,
                                    args.dtype, device)
            rows.append(r)
    out = layout().results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory-models.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    lines = [
        f"Capture path per model (tiny real model, the spec's width, K={len(layers)}, "
        f"{args.dtype}, {device}; exact live bytes on CPU): the captures the forward hands "
        "over plus what packing them adds, pristine base against the series, one process. "
        "Bytes; x = multiples of the captures (K*T*H*itemsize).",
        "",
        "| model | T | H | captures | pristine | series | pristine x | series x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, a, b = (r["capture_bytes"], r["pin"]["capture_path_peak_bytes"],
                   r["patched"]["capture_path_peak_bytes"])
        lines.append(f"| {r['family']} | {r['tokens']} | {r['hidden']} | {s:,} | {a:,} | {b:,} | "
                     f"{a / s:.3f} | {b / s:.3f} |")
    md = "\n".join(lines) + "\n"
    (out / "memory-models.md").write_text(md)
    print(md)
    print(f"[bench] wrote {layout().rel(out / 'memory-models.json')} and memory-models.md")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.engine:
        from harness.e2e import bench as engine_bench

        return engine_bench.run(args)
    if args.pp:
        return _run_pp(args)
    if args.models:
        return _run_models(args)
    import torch

    from harness.memory.capture import capture_path
    from harness.ranks.sglang import init_sglang_distributed

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    init_sglang_distributed(rank=0, world_size=1)
    rows = []
    for tokens in args.tokens:
        t0 = time.monotonic()
        lst = capture_path("list", tokens, args.hidden, args.k, args.dtype, device)
        pk = capture_path("packer", tokens, args.hidden, args.k, args.dtype, device)
        rows.append({
            "tokens": tokens,
            "capture_bytes": lst["capture_bytes"],
            "list_peak_bytes": lst["peak_bytes"],
            "packer_peak_bytes": pk["peak_bytes"],
            "ratio_packer_over_list": pk["peak_bytes"] / lst["peak_bytes"] if lst["peak_bytes"] else None,
            "list_copied_bytes": lst["copied_bytes"],
            "packer_copied_bytes": pk["copied_bytes"],
            "seconds": round(time.monotonic() - t0, 2),
        })
        print(f"[bench] T={tokens}: list peak {_mib(lst['peak_bytes'])} MiB, "
              f"packer peak {_mib(pk['peak_bytes'])} MiB", flush=True)
    meta = {"hidden": args.hidden, "k": args.k, "dtype": args.dtype, "device": device,
            "tracker": "live-storage (exact)" if device == "cpu" else "CUDA allocator peak",
            "torch": torch.__version__}
    out = layout().results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"Aux-capture path peak memory, H={args.hidden}, K={args.k}, {args.dtype}, {device} "
        f"({meta['tracker']}); MiB over baseline.",
        "",
        "| T | captures (K*T*H) | list+cat peak | packer peak | packer/list | copied list | copied packer |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "n/a" if r["ratio_packer_over_list"] is None else f"{r['ratio_packer_over_list']:.3f}"
        lines.append(
            f"| {r['tokens']} | {_mib(r['capture_bytes'])} | {_mib(r['list_peak_bytes'])} | "
            f"{_mib(r['packer_peak_bytes'])} | {ratio} | {_mib(r['list_copied_bytes'])} | "
            f"{_mib(r['packer_copied_bytes'])} |"
        )
    if args.family:
        model_rows = _model_rows(args, device)
        (out / "memory.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "model_rows": model_rows}, indent=2) + "\n")
        lines += [
            "",
            f"Whole model, {args.family} (tiny real model, {args.model_hidden} hidden, 8 layers, "
            f"K={args.k}, EAGLE3 default ids), the pin's forward (list) against the series' "
            "(packed), one process. Capture path = the captures the forward hands over + what "
            "packing them adds; forward = peak of forward + pack over baseline. MiB.",
            "",
            "| T | captures | pin capture path | series capture path | series/pin | pin forward | series forward | forward without captures |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in model_rows:
            lines.append(
                f"| {r['tokens']} | {_mib(r['capture_bytes'])} | {_mib(r['pin']['capture_path_peak_bytes'])} | "
                f"{_mib(r['patched']['capture_path_peak_bytes'])} | {r['ratio_patched_over_pin']:.3f} | "
                f"{_mib(r['pin']['forward_peak_bytes'])} | {_mib(r['patched']['forward_peak_bytes'])} | "
                f"{_mib(r['patched']['forward_peak_without_captures_bytes'])} |"
            )
    md = "\n".join(lines) + "\n"
    (out / "memory.md").write_text(md)
    print(md)
    print(f"[bench] wrote {layout().rel(out / 'memory.json')} and memory.md")
    return 0
