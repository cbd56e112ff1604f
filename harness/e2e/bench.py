"""``bench --engine``: what returning aux hidden states costs, in SGLang's real Engine
and on the return path alone.

**In the Engine**, per width ``K * H`` (``--widths``; default 768, 4,096 and 12,288: K = 3
x H = 256, K = 4 x H = 1,024, K = 3 x H = 4,096), five Engines (four above
``FLAG_MAX_WIDTH``) of the same llama checkpoint (``harness.parity`` family, H wide,
``--engine-layers`` deep), SGLang's Engine on the CPU (``harness.e2e.engine``), one
driver process each, all up at once (started side by side, or one at a time when their
weights together pass ``PARALLEL_START_SHARE`` of the available memory):

- ``pristine-lists``: the base's pristine release (``git archive base/v<version>
  python/sglang`` first on the driver's ``PYTHONPATH``): its list + ``torch.cat`` capture
  and its return path (``.cpu().tolist()`` per request, floats across the pipes);
- ``series-lists``: the installed patched wheel, the lists of before
  (``return_hidden_states``);
- ``series-arrays``: the same Engine arguments, each request asking for one tensor
  (``return_raw_hidden_states``, patch ``return-hidden-states-arrays``);
- ``series-flag`` (diagnostic): the capturing Engine's arguments, requests that ask
  for no features: what the flag costs by itself (its capture in the forward, its
  full hidden-states mode), apart from the return path;
- ``plain``: the patched wheel without ``--enable-return-aux-hidden-states`` and
  without ``return_hidden_states``: the same generation, no features.

The capturing three run with ``--enable-return-aux-hidden-states`` (K ids, none the
last layer's, which pristine 0.5.23 cannot capture). Every round sends the same batch
(radix cache off: every round prefills again) to each Engine, one after another, the
order rotated each round, the Engines not measured stopped (SIGSTOP: an idle SGLang
scheduler spins in its event loop); one warm-up round is dropped. Per variant and width:
the ratio of its rows/s to plain's in the same round (the same seconds of machine load),
median, min and max over rounds: ``ratio_to_plain``. A row is one token's K captures:
one per prompt token and per generated token but the last; plain's rows/s counts the
same token positions, so each ratio is a ratio of wall times of ``Engine.generate``
(measured in the driver). The three capturing variants' rows must have the same digest.

**The return path alone** (:mod:`harness.e2e.return_path`): the result processor, the
scheduler -> detokenizer -> tokenizer-manager pipes and what the caller gets, without a
forward, at the same widths and batch sizes 1, 16 and 64 (``--return-batches``): rows/s
per variant, and the share of a token's time it takes, against plain generation's
rows/s measured above; then what that share means on a GPU (``projection``: each
assumption stated) and the physical floor of moving K * H bfloat16 values a token.

Writes ``<results>/bench/engine.{json,md}``. A benchmark, not a test: no thresholds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from harness import HarnessError
from harness.patchset.git import export_commit

VARIANTS = ("pristine-lists", "series-lists", "series-arrays", "series-flag", "plain")
# The variants that return features; series-flag runs the capturing Engine's arguments
# with requests that ask for none: the cost of the flag itself (its capture in the
# forward, its full hidden-states mode) without the return path.
CAPTURING = VARIANTS[:3]
RATIOED = VARIANTS[:4]
# The diagnostic runs up to this width: at K*H = 12,288 (H = 4,096) five Engines of about
# 4.2 GB each leave SGLang's memory profile no room for a KV cache on a 24 GB machine.
FLAG_MAX_WIDTH = 4096


def variants_at(width: int) -> tuple[str, ...]:
    return VARIANTS if width <= FLAG_MAX_WIDTH else tuple(v for v in VARIANTS if v != "series-flag")


# SGLang's memory profile (mem_cache/kv_cache_configurator.py, _profile_available_bytes)
# takes all the memory that goes while an Engine loads its weights as that Engine's: Engines
# loading side by side count each other's weights, and at K*H 12,288 (about 4.2 GB each)
# one of them finds "no GPU memory for the KV cache". They start one at a time when their
# weights together exceed this share of the available memory.
PARALLEL_START_SHARE = 0.25

LABELS = {
    "pristine-lists": "pristine: list + torch.cat, lists of floats",
    "series-lists": "series: packer, the lists of before",
    "series-arrays": "series: packer, one tensor a request",
    "series-flag": "series: the flag on, no request asks (diagnostic)",
    "plain": "plain: no capture",
}
PROVENANCE_ENV = "HARNESS_BENCH_PROVENANCE"
PROMPT_TOKENS = (3, 140)  # the parity vocabulary's ordinary ids
# K * H -> (K, H): the widths of the issue, each K at most 4 so the ids fit 6 layers.
SHAPES = {768: (3, 256), 4096: (4, 1024), 12288: (3, 4096)}

# What the GPU projection assumes (each stated in the report): an EAGLE3 draft's
# features of Llama-3.1-8B (K = 3 x H = 4,096), bfloat16, on one H100 SXM in SGLang.
GPU_ASSUMPTIONS = {
    "model": "Llama-3.1-8B target of an EAGLE3 draft: K = 3, H = 4,096, K * H = 12,288 values a token",
    "dtype_bytes": 2,
    "card": "one H100 SXM",
    "prefill_tokens_per_s": 40000.0,
    "prefill_source": "assumed: prefill of an 8B bf16 model at about 40k tokens/s on one H100 "
                      "(compute-bound, ~16 GFLOP a token at ~650 TFLOP/s dense bf16, half efficiency); "
                      "a trainer's features are mostly prompt rows",
    "decode_tokens_per_s": 8000.0,
    "decode_source": "assumed: decode at batch 64, about 8k tokens/s (memory-bound: 16 GB of weights "
                     "read per step at ~3.3 TB/s, about 8 ms a step, 64 tokens a step)",
    "pcie_bytes_per_s": 50e9,
    "pcie_source": "assumed: device-to-host over PCIe 5.0 x16, about 50 GB/s in practice",
    "host_copy_bytes_per_s": 10e9,
    "host_copy_source": "assumed: one host memcpy stream, about 10 GB/s",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine benchmark (--engine)")
    g.add_argument("--engine", action="store_true",
                   help="instead of the memory benchmark: what returning features costs, in the real Engine "
                        "and on the return path alone (BASE=0.5.23)")
    g.add_argument("--rounds", type=int, default=7, help="measured rounds per width, after one warm-up (default 7)")
    g.add_argument("--prompts", type=int, default=16, help="requests per batch (default 16)")
    g.add_argument("--prompt-len", type=int, default=64, help="prompt tokens each (default 64)")
    g.add_argument("--new-tokens", type=int, default=8, help="generated tokens each (default 8)")
    g.add_argument("--widths", default="768,4096,12288",
                   help=f"K * H of the Engines, comma-separated, each of {sorted(SHAPES)} (default all)")
    g.add_argument("--engine-layers", type=int, default=6, help="the llama's layers (default 6)")
    g.add_argument("--return-batches", default="1,16,64",
                   help="batch sizes of the return-path measurement (default 1,16,64)")
    g.add_argument("--return-repeats", type=int, default=3, help="its repeats, after a warm-up (default 3)")
    g.add_argument("--no-engine-runs", action="store_true", help="only the return path (no Engines)")


# ------------------------------------------------------------------------ pure logic

def layer_ids(layers: int, k: int = 3) -> tuple[int, ...]:
    """``k`` EAGLE3 ids, spread over the layers, none the last layer's (pristine 0.5.23
    has no final-layer capture: it would return K - 1 slots)."""
    if layers < k + 2:
        raise ValueError(f"the engine benchmark needs at least {k + 2} layers for {k} ids")
    if k == 3:
        return (1, layers // 2, layers - 2)
    return tuple(range(1, k + 1))


def shape(width: int) -> tuple[int, int]:
    """(K, H) of a width of ``SHAPES``."""
    if width not in SHAPES:
        raise ValueError(f"width {width}: one of {sorted(SHAPES)}")
    return SHAPES[width]


def expected_rows(prompt_len: int, new_tokens: int, prompts: int) -> int:
    """Rows a batch returns: each prompt token and each generated token but the last."""
    return prompts * (prompt_len + new_tokens - 1)


def rotation(round_index: int, variants: Sequence[str] = VARIANTS) -> list[str]:
    """Round ``i``'s order: ``variants`` rotated by ``i``."""
    k = round_index % len(variants)
    return list(variants[k:]) + list(variants[:k])


def ratios_to_plain(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per variant but plain, its rows/s over plain's in the same round (plain's wall
    time over its own), median, min and max over the rounds."""
    by_round: dict[Any, dict[str, float]] = {}
    for s in samples:
        by_round.setdefault(s["round"], {})[s["variant"]] = s["seconds"]
    out = {}
    for v in RATIOED:
        within = [r["plain"] / r[v] for r in by_round.values() if v in r and "plain" in r]
        if within:
            out[v] = {"median": statistics.median(within), "min": min(within), "max": max(within),
                      "n": len(within)}
    return out


def projection(return_path: Sequence[dict[str, Any]], assumptions: dict[str, Any] = GPU_ASSUMPTIONS) -> dict:
    """What the return path alone costs a GPU server at the widest width and largest
    batch measured: per variant, the share of the time of a token (prefill and decode)
    that returning its row takes, if the return path runs at the rows/s measured here
    and does not overlap the forward; and the physical floor (the bytes of a row over
    PCIe, and over one host copy)."""
    widest = max(r["width"] for r in return_path)
    batch = max(r["batch"] for r in return_path if r["width"] == widest)
    row_bytes = widest * assumptions["dtype_bytes"]
    out: dict[str, Any] = {"width": widest, "batch": batch, "row_bytes": row_bytes,
                           "assumptions": assumptions, "variants": {}}
    for r in return_path:
        if r["width"] != widest or r["batch"] != batch:
            continue
        out["variants"][r["variant"]] = {
            "rows_per_s": r["rows_per_s"],
            "share_of_prefill_token": assumptions["prefill_tokens_per_s"] / (
                assumptions["prefill_tokens_per_s"] + r["rows_per_s"]),
            "share_of_decode_token": assumptions["decode_tokens_per_s"] / (
                assumptions["decode_tokens_per_s"] + r["rows_per_s"]),
        }
    out["floor"] = {
        "pcie_rows_per_s": assumptions["pcie_bytes_per_s"] / row_bytes,
        "host_copy_rows_per_s": assumptions["host_copy_bytes_per_s"] / row_bytes,
        "share_of_prefill_token_at_pcie": assumptions["prefill_tokens_per_s"] * row_bytes
        / assumptions["pcie_bytes_per_s"],
    }
    return out


def _mib(n: int | None) -> str:
    return "n/a" if not n else f"{n / 2**20:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [f"Returning features in SGLang {m['base']}'s Engine (CPU, {m['cores']} cores): llama, "
             f"{m['layers']} layers, float32; {m['prompts']} prompts x {m['prompt_len']} tokens, "
             f"{m['new_tokens']} new tokens each; {m['rounds']} rounds per width after one warm-up, order "
             "rotated each round. ratio_to_plain = the variant's rows/s over plain generation's in the same "
             "round (median, min-max over rounds).", ""]
    if report.get("engine"):
        lines += ["| K * H | K x H | variant | ratio_to_plain (median) | min-max | rows/s | peak RSS MiB |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        for row in report["engine"]:
            r = row["ratio_to_plain"]
            rs = f"{r['median']:.3f}" if r else "1"
            mm = f"{r['min']:.3f}-{r['max']:.3f}" if r else "-"
            lines.append(f"| {row['width']:,} | {row['k']} x {row['hidden']} | {LABELS[row['variant']]} | {rs} | "
                         f"{mm} | {row['rows_per_s']:,.0f} | {_mib(row.get('peak_rss_bytes'))} |")
        lines += ["", "Same features: " + "; ".join(f"{w}: {v}" for w, v in report["same_features"].items()),
                  "SGLang per variant: " + "; ".join(f"{v}: {p}" for v, p in report["provenance"].items()), ""]
    rp = report.get("return_path") or []
    if rp:
        lines += ["The return path alone (result processor -> pipes -> caller; "
                  f"{rp[0]['prompt']}-token prefill + {rp[0]['decode_steps']} decode steps a request, "
                  "bfloat16 rows; rows/s, median of "
                  f"{report['meta']['return_repeats']} repeats):", "",
                  "| K * H | batch | pristine lists | series lists | series arrays | arrays / pristine |",
                  "|---:|---:|---:|---:|---:|---:|"]
        keys = sorted({(r["width"], r["batch"]) for r in rp})
        for w, b in keys:
            got = {r["variant"]: r["rows_per_s"] for r in rp if r["width"] == w and r["batch"] == b}
            lines.append(f"| {w:,} | {b} | {got['pristine-lists']:,.0f} | {got['series-lists']:,.0f} | "
                         f"{got['series-arrays']:,.0f} | {got['series-arrays'] / got['pristine-lists']:.1f}x |")
        shares = report.get("share_of_token") or []
        if shares:
            lines += ["", "Share of a token's time on this CPU (return path at batch "
                      f"{shares[0]['batch']}, against plain generation's rows/s in the Engine):", "",
                      "| K * H | pristine lists | series lists | series arrays |", "|---:|---:|---:|---:|"]
            for s in shares:
                lines.append(f"| {s['width']:,} | {s['pristine-lists']:.1%} | {s['series-lists']:.1%} | "
                             f"{s['series-arrays']:.1%} |")
        p = report.get("projection")
        if p:
            a = p["assumptions"]
            lines += ["", f"On a GPU ({a['model']}; {a['card']}): the share of a token's time the return path "
                      f"would take at K * H = {p['width']:,}, batch {p['batch']}, at the rows/s measured here:", "",
                      "| variant | prefill token | decode token |", "|---|---:|---:|"]
            for v, x in p["variants"].items():
                lines.append(f"| {v} | {x['share_of_prefill_token']:.1%} | {x['share_of_decode_token']:.1%} |")
            f = p["floor"]
            lines += ["", f"Physical floor: a row is {p['row_bytes']:,} bytes; over PCIe "
                      f"{f['pcie_rows_per_s']:,.0f} rows/s, one host copy {f['host_copy_rows_per_s']:,.0f} "
                      f"rows/s (a prefill token's row costs {f['share_of_prefill_token_at_pcie']:.1%} of "
                      "its time at PCIe speed).", "Assumptions: " + "; ".join(
                          a[k] for k in ("prefill_source", "decode_source", "pcie_source", "host_copy_source"))]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- engine processes

def record_provenance() -> None:
    """Setup hook run in each Engine process: which SGLang it imported (written to
    ``$HARNESS_BENCH_PROVENANCE/<pid>.json``)."""
    import inspect

    import sglang.srt.layers.aux_hidden_states as aux
    from sglang.srt.models.llama import LlamaModel

    src = inspect.getsource(LlamaModel.forward)
    collector = ("packer" if "AuxHiddenStatePacker" in src else "list" if "AuxHiddenStateList" in src
                 else "unknown")
    out = Path(os.environ[PROVENANCE_ENV])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{os.getpid()}.json").write_text(json.dumps({"aux_hidden_states": aux.__file__,
                                                         "llama_collector": collector}))


def read_provenance(directory: Path) -> list[dict[str, str]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def check_provenance(variant: str, records: list[dict[str, str]], pristine: Path) -> str:
    """One line saying where ``variant``'s Engine got SGLang; raises when it is not the
    tree it should be (pristine: under ``pristine`` with the list; else not, packer)."""
    if not records:
        raise HarnessError(f"engine bench: {variant}'s Engine processes recorded no SGLang")
    want_pristine = variant.startswith("pristine")
    for r in records:
        inside = Path(r["aux_hidden_states"]).resolve().is_relative_to(pristine.resolve())
        collector = r["llama_collector"]
        if inside != want_pristine or collector != ("list" if want_pristine else "packer"):
            raise HarnessError(f"engine bench: {variant}'s Engine ran {r['aux_hidden_states']} "
                               f"(LlamaModel collects in a {collector})")
    where = "pristine export" if want_pristine else "installed patched wheel"
    return f"{where}, LlamaModel {records[0]['llama_collector']} ({len(records)} processes)"


def pristine_tree(lay, tag: str) -> Path:
    """``python/sglang`` of ``tag`` in the base's tree, exported once to
    ``build/bench-engine[-<base>]/pristine`` (re-exported when the tag moves); returns the
    directory to put on ``PYTHONPATH``."""
    tree = lay.tree
    if not (tree / ".git").exists():
        raise HarnessError(f"{lay.rel(tree)} is missing: run `make apply-patches` first")
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", f"{tag}^{{commit}}"],
                                check=True, capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise HarnessError(f"{lay.rel(tree)} has no {tag}: {exc.stderr.strip()}") from exc
    dest = lay.build / ("bench-engine" if lay.base is None else f"bench-engine-{lay.base}") / "pristine"
    return export_commit(tree, commit, "python/sglang", dest) / "python"


def _checkpoint(directory: Path, hidden: int, layers: int) -> Path:
    from harness.parity import reference
    from harness.parity.families import families, tiny_fields

    heads = max(4, hidden // 64)
    fam = dataclasses.replace(families()["llama"], config=lambda: tiny_fields(
        hidden_size=hidden, intermediate_size=max(hidden // 2, 64), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=hidden // heads,
        max_position_embeddings=512))
    reference.make_checkpoint(fam, directory)
    return directory


def _configs(ckpt: Path, ids: Sequence[int], prompts: int, tokens: int, provenance: Path):
    from harness.e2e.engine import EngineConfig

    common = dict(attention_backend="torch_native", skip_tokenizer_init=True, max_running_requests=prompts,
                  max_total_tokens=max(2048, prompts * tokens), disable_radix_cache=True)
    capture = dict(common, enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                   return_aux_hidden_state_layer_ids=list(ids))
    return {v: EngineConfig(key=f"bench-{v}", model="llama", target=str(ckpt),
                            extra=tuple((common if v == "plain" else capture).items()),
                            setup=("harness.e2e.bench:record_provenance",),
                            env=((PROVENANCE_ENV, str(provenance / v)),))
            for v in VARIANTS}


def _weights_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def _available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def _parallel(calls: dict[str, Any]) -> None:
    """Run each callable in a thread of its own; raise the first error."""
    errors: dict[str, BaseException] = {}

    def wrap(name, fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[name] = exc

    threads = [threading.Thread(target=wrap, args=(n, f)) for n, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, exc in errors.items():
        raise HarnessError(f"engine bench: {name}: {exc}") from exc


def _width_runs(args, lay, base: str, pristine: Path, width: int, root: Path) -> dict[str, Any]:
    """The Engines at one width: rounds, ratios, rows/s, peak RSS, provenance."""
    import torch

    from harness.e2e.engine import Session

    variants = variants_at(width)
    k, hidden = shape(width)
    ids = layer_ids(args.engine_layers, k)
    rows = expected_rows(args.prompt_len, args.new_tokens, args.prompts)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(*PROMPT_TOKENS, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    ckpt = _checkpoint(root / f"llama-{width}", hidden, args.engine_layers)
    configs = _configs(ckpt, ids, args.prompts, args.prompt_len + args.new_tokens, root / f"provenance-{width}")
    env_pristine = dict(os.environ)
    env_pristine["PYTHONPATH"] = os.pathsep.join(
        [str(pristine)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sessions = {v: Session(root / f"{v}-{width}", base=f"{base} ({v})",
                           env=env_pristine if v.startswith("pristine") else None) for v in variants}
    samples: list[dict[str, Any]] = []
    digests: dict[str, set[str]] = {v: set() for v in CAPTURING}
    t0 = time.monotonic()
    try:
        print(f"[bench] width {width} (K {k} x H {hidden}): starting {len(variants)} engine drivers",
              flush=True)
        starts = {v: (lambda v=v: sessions[v].ensure(configs[v])) for v in variants}
        if _weights_bytes(ckpt) * len(variants) > PARALLEL_START_SHARE * _available_bytes():
            print("[bench] their weights together are large: starting them one at a time", flush=True)
            for start in starts.values():
                start()
        else:
            _parallel(starts)
        print(f"[bench] engines up after {time.monotonic() - t0:.0f} s", flush=True)
        for s in sessions.values():
            s.pause()
        for r in range(args.rounds + 1):
            for v in rotation(r, variants):
                s = sessions[v]
                capture = v in CAPTURING
                s.resume()
                outs = s.generate(None, sampling, input_ids=batch, return_hidden_states=capture,
                                  hidden_summary=capture, raw_hidden_states=v == "series-arrays")
                s.pause()
                got_rows = sum(o.get("hidden_rows", 0) for o in outs)
                if capture:
                    widths = {o.get("hidden_width") for o in outs}
                    if got_rows != rows or widths != {width}:
                        raise HarnessError(f"engine bench: {v} returned {got_rows} rows of width {widths}, "
                                           f"expected {rows} of {width}")
                    if v == "series-arrays" and {o.get("hidden_type") for o in outs} != {"Tensor"}:
                        raise HarnessError(f"engine bench: series-arrays got {outs[0].get('hidden_type')}")
                    digests[v].add("".join(o["hidden_sha256"] for o in outs))
                if r:
                    samples.append({"variant": v, "round": r, "seconds": s.last_generate_s})
            print(f"[bench] width {width} round {r}{' (warm-up)' if r == 0 else ''}: "
                  + ", ".join(f"{v} {sessions[v].last_generate_s:.3f} s" for v in rotation(r, variants)), flush=True)
        rss = {v: sessions[v].rss().get("engine_peak_rss_bytes") for v in variants}
    finally:
        for s in sessions.values():
            if s.proc is not None and s.current is not None:
                try:
                    s.resume()  # a stopped Engine cannot shut down
                except Exception:  # noqa: BLE001 - close() kills the group anyway
                    pass
            s.close()
    provenance = {v: check_provenance(v, read_provenance(root / f"provenance-{width}" / v), pristine)
                  for v in variants}
    same = (len({d for ds in digests.values() for d in ds}) == 1
            and all(len(ds) == 1 for ds in digests.values()))
    ratios = ratios_to_plain(samples)
    out = []
    for v in variants:
        secs = [s["seconds"] for s in samples if s["variant"] == v]
        out.append({"width": width, "k": k, "hidden": hidden, "layer_ids": list(ids), "variant": v,
                    "ratio_to_plain": ratios.get(v), "median_s": statistics.median(secs),
                    "rows_per_s": rows / statistics.median(secs), "peak_rss_bytes": rss[v]})
    return {"rows": out, "same": "yes (identical rows, sha256 of float32 bytes)" if same else
            f"NO: {({v: len(d) for v, d in digests.items()})} digests", "provenance": provenance}


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from harness.e2e import return_path
    from harness.patchset.layout import layout

    lay = layout()
    base = lay.label
    tag = f"base/v{base}"
    has_flag = subprocess.run(["git", "-C", str(lay.tree), "grep", "-q", "enable_return_aux_hidden_states",
                               tag, "--", "python/sglang/srt"], capture_output=True)
    if has_flag.returncode != 0:
        raise HarnessError(f"engine bench: SGLang {base} has no --enable-return-aux-hidden-states "
                           "(run it with BASE=0.5.23)")
    widths = [int(w) for w in args.widths.split(",") if w]
    for w in widths:
        shape(w)
    batches = [int(b) for b in args.return_batches.split(",") if b]
    t_start = time.monotonic()
    engine_rows: list[dict[str, Any]] = []
    same, provenance = {}, {}
    if not args.no_engine_runs:
        pristine = pristine_tree(lay, tag)
        with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
            for w in widths:
                got = _width_runs(args, lay, base, pristine, w, Path(tmp))
                engine_rows += got["rows"]
                same[str(w)] = got["same"]
                provenance = got["provenance"]
    print("[bench] the return path alone", flush=True)
    rp = return_path.measure(widths, batches, args.prompt_len, args.new_tokens, args.return_repeats)
    shares = []
    biggest = max(batches)
    for w in widths:
        plain = next((r for r in engine_rows if r["width"] == w and r["variant"] == "plain"), None)
        if plain is None:
            continue
        per = {r["variant"]: r["rows_per_s"] for r in rp if r["width"] == w and r["batch"] == biggest}
        shares.append({"width": w, "batch": biggest, "plain_rows_per_s": plain["rows_per_s"],
                       **{v: plain["rows_per_s"] / (plain["rows_per_s"] + per[v]) for v in per}})
    report = {
        "meta": {"base": base, "cores": os.cpu_count(), "layers": args.engine_layers, "prompts": args.prompts,
                 "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds,
                 "return_repeats": args.return_repeats, "torch": torch.__version__,
                 "wall_s": round(time.monotonic() - t_start, 1)},
        "engine": engine_rows,
        "same_features": same,
        "provenance": provenance,
        "return_path": rp,
        "share_of_token": shares,
        "projection": projection(rp),
    }
    out = lay.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (out / "engine.md").write_text(md)
    print(md)
    print(f"[bench] wrote {lay.rel(out / 'engine.json')} and engine.md ({report['meta']['wall_s']} s)")
    return 0
