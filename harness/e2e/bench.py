"""``bench --engine``: what returning aux hidden states costs in SGLang's real Engine.

Three Engines of the same tiny llama checkpoint (``harness.parity`` family, wider and
deeper than the parity tier's), SGLang's Engine on the CPU (``harness.e2e.engine``), one
driver process each, all running at once:

- ``pristine``: the base's pristine release (``git archive base/v<version> python/sglang``
  first on the driver's ``PYTHONPATH``): ``LlamaModel`` collects its captures in
  ``AuxHiddenStateList`` and the logits processor ``torch.cat``\\ s them;
- ``series``: the installed patched wheel: ``AuxHiddenStatePacker`` writes each capture
  into one preallocated ``[T, K * H]`` buffer;
- ``no-capture``: the patched wheel without ``--enable-return-aux-hidden-states`` and
  without ``return_hidden_states``: the same generation, no features.

The first two run with ``--enable-return-aux-hidden-states`` (K = 3 ids, none the last
layer's, which pristine 0.5.23 cannot capture) and every request asks
``return_hidden_states``. Every round sends the same batch (radix cache off: every round
prefills again) to each Engine, one after another, the order rotated each round (ABC,
BCA, CAB, ...), the two Engines not measured stopped (SIGSTOP: an idle SGLang scheduler
spins in its event loop); one warm-up round is dropped; the median per variant is reported.

Throughput: ``rows/s`` = feature rows / wall time of ``Engine.generate`` (measured in the
driver, so the harness's pipe is not in it). A row is one token's K captures, ``K * H``
float32 values: one per prompt token and per generated token but the last. ``no-capture``
returns none; its rows/s counts the same token positions, so every ratio of rows/s is a
ratio of wall times. Each Engine process checks which SGLang it imported (a setup hook:
where ``aux_hidden_states`` comes from, whether ``LlamaModel.forward`` uses the packer),
and the pristine and series rows must have the same digest (the same features).
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

VARIANTS = ("pristine", "series", "no-capture")
LABELS = {
    "pristine": "(a) pristine: list + torch.cat",
    "series": "(b) series: AuxHiddenStatePacker",
    "no-capture": "(c) no capture",
}
RATIOS = (("series", "pristine"), ("pristine", "no-capture"), ("series", "no-capture"))
PROVENANCE_ENV = "HARNESS_BENCH_PROVENANCE"
PROMPT_TOKENS = (3, 140)  # the parity vocabulary's ordinary ids


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine benchmark (--engine)")
    g.add_argument("--engine", action="store_true",
                   help="instead of the memory benchmark: features/s returned by the real Engine, "
                        "pristine base vs series vs no capture (BASE=0.5.23)")
    g.add_argument("--rounds", type=int, default=15, help="measured rounds, after one warm-up (default 15)")
    g.add_argument("--prompts", type=int, default=16, help="requests per batch (default 16)")
    g.add_argument("--prompt-len", type=int, default=128, help="prompt tokens each (default 128)")
    g.add_argument("--new-tokens", type=int, default=8, help="generated tokens each (default 8)")
    g.add_argument("--engine-hidden", type=int, default=256, help="hidden size of the llama (default 256)")
    g.add_argument("--engine-layers", type=int, default=8, help="its layers (default 8)")


# ------------------------------------------------------------------------ pure logic

def layer_ids(layers: int) -> tuple[int, ...]:
    """Three EAGLE3 ids, none the last layer's (pristine 0.5.23 has no final-layer
    capture: it would return K - 1 slots)."""
    if layers < 4:
        raise ValueError("the engine benchmark needs at least 4 layers")
    return (1, layers // 2, layers - 2)


def expected_rows(prompt_len: int, new_tokens: int, prompts: int) -> int:
    """Rows a batch returns: each prompt token and each generated token but the last."""
    return prompts * (prompt_len + new_tokens - 1)


def rotation(round_index: int, variants: Sequence[str] = VARIANTS) -> list[str]:
    """Round ``i``'s order: ``variants`` rotated by ``i`` (ABC, BCA, CAB, ...)."""
    k = round_index % len(variants)
    return list(variants[k:]) + list(variants[:k])


def summarize(samples: Sequence[dict[str, Any]], rows: int, width: int) -> dict[str, Any]:
    """Per variant the median wall time of a batch (and min, max, n), rows/s and MiB/s of
    features at the median; the ratios of ``RATIOS`` (rows/s over rows/s)."""
    per: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        secs = [s["seconds"] for s in samples if s["variant"] == v]
        if not secs:
            continue
        med = statistics.median(secs)
        per[v] = {"n": len(secs), "median_s": med, "min_s": min(secs), "max_s": max(secs),
                  "rows_per_s": rows / med, "feature_mib_per_s": rows * width * 4 / 2**20 / med}
    ratios = {f"{a}/{b}": per[a]["rows_per_s"] / per[b]["rows_per_s"]
              for a, b in RATIOS if a in per and b in per}
    # Paired: per round, the ratio of the two variants' rows/s in that round (the same
    # few seconds of machine load), then the median over rounds; slow drift in the
    # load cancels within a round, which the medians of wall times above do not.
    by_round: dict[Any, dict[str, float]] = {}
    for sample in samples:
        if "round" in sample:
            by_round.setdefault(sample["round"], {})[sample["variant"]] = sample["seconds"]
    paired = {}
    for a, b in RATIOS:
        within = [r[b] / r[a] for r in by_round.values() if a in r and b in r]
        if within:
            paired[f"{a}/{b}"] = statistics.median(within)
    return {"variants": per, "ratios": ratios, "paired_ratios": paired}


def _mib(n: int | None) -> str:
    return "n/a" if not n else f"{n / 2**20:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    m, s = report["meta"], report["summary"]
    lines = [
        f"Capture cost in SGLang {m['base']}'s Engine (CPU, {m['cores']} cores): {m['family']}, "
        f"H = {m['hidden']}, {m['layers']} layers, K = {m['k']} (ids {m['layer_ids']}), float32; "
        f"{m['prompts']} prompts x {m['prompt_len']} tokens, {m['new_tokens']} new tokens each; "
        f"{m['rows']} feature rows of K*H = {m['width']} per batch. {m['rounds']} rounds after one "
        "warm-up, order rotated each round; median per variant. rows/s = rows / wall time of "
        "Engine.generate (no-capture: the same token positions, none returned).",
        "",
        "| variant | median s | min-max s | rows/s | features MiB/s | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        r = s["variants"].get(v)
        if r is None:
            continue
        rss = report.get("rss", {}).get(v, {}).get("engine_peak_rss_bytes")
        feat = "-" if v == "no-capture" else f"{r['feature_mib_per_s']:,.1f}"
        lines.append(f"| {LABELS[v]} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
                     f"{r['rows_per_s']:,.0f} | {feat} | {_mib(rss)} |")
    lines += ["", "| ratio of rows/s | value |", "|---|---:|"]
    names = {"series/pristine": "b/a (series over pristine)", "pristine/no-capture": "a/c (pristine over no capture)",
             "series/no-capture": "b/c (series over no capture)"}
    lines[-2:] = ["| ratio of rows/s | of the medians | paired (median of per-round ratios) |",
                  "|---|---:|---:|"]
    for key, value in s["ratios"].items():
        pair = s.get("paired_ratios", {}).get(key)
        lines.append(f"| {names.get(key, key)} | {value:.3f} | {'-' if pair is None else f'{pair:.3f}'} |")
    lines += ["", f"Same features: {report['same_features']}. Peak RSS: the largest VmHWM among each "
              "Engine's processes (the scheduler), since it started.",
              "SGLang per variant: " + "; ".join(f"{v}: {p}" for v, p in report["provenance"].items())]
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
    want_pristine = variant == "pristine"
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

    heads = max(4, hidden // 32)
    fam = dataclasses.replace(families()["llama"], config=lambda: tiny_fields(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
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
    out = {}
    for v in VARIANTS:
        extra = common if v == "no-capture" else capture
        out[v] = EngineConfig(key=f"bench-{v}", model="llama", target=str(ckpt), extra=tuple(extra.items()),
                              setup=("harness.e2e.bench:record_provenance",),
                              env=((PROVENANCE_ENV, str(provenance / v)),))
    return out


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


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from harness.e2e.engine import Session
    from harness.patchset.layout import layout

    lay = layout()
    base = lay.label
    tag = f"base/v{base}"
    has_flag = subprocess.run(["git", "-C", str(lay.tree), "grep", "-q", "enable_return_aux_hidden_states",
                               tag, "--", "python/sglang/srt"], capture_output=True)
    if has_flag.returncode != 0:
        raise HarnessError(f"engine bench: SGLang {base} has no --enable-return-aux-hidden-states "
                           "(run it with BASE=0.5.23)")
    pristine = pristine_tree(lay, tag)
    ids = layer_ids(args.engine_layers)
    k, width = len(ids), len(ids) * args.engine_hidden
    rows = expected_rows(args.prompt_len, args.new_tokens, args.prompts)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(*PROMPT_TOKENS, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        root = Path(tmp)
        ckpt = _checkpoint(root / "llama", args.engine_hidden, args.engine_layers)
        configs = _configs(ckpt, ids, args.prompts, args.prompt_len + args.new_tokens, root / "provenance")
        env_pristine = dict(os.environ)
        env_pristine["PYTHONPATH"] = os.pathsep.join(
            [str(pristine)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        sessions = {v: Session(root / v, base=f"{base} ({v})", env=env_pristine if v == "pristine" else None)
                    for v in VARIANTS}
        samples: list[dict[str, Any]] = []
        digests: dict[str, set[str]] = {v: set() for v in VARIANTS}
        try:
            print(f"[bench] starting 3 engine drivers (pristine from {lay.rel(pristine)})", flush=True)
            _parallel({v: (lambda v=v: sessions[v].ensure(configs[v])) for v in VARIANTS})
            print(f"[bench] engines up after {time.monotonic() - t_start:.0f} s", flush=True)
            # An idle SGLang scheduler spins in its event loop: the Engines waiting their
            # turn are stopped (SIGSTOP) so that they leave the cores to the one measured.
            for s in sessions.values():
                s.pause()
            for r in range(args.rounds + 1):
                for v in rotation(r):
                    s = sessions[v]
                    capture = v != "no-capture"
                    s.resume()
                    outs = s.generate(None, sampling, input_ids=batch, return_hidden_states=capture,
                                      hidden_summary=capture)
                    s.pause()
                    got_rows = sum(o.get("hidden_rows", 0) for o in outs)
                    if capture:
                        widths = {o.get("hidden_width") for o in outs}
                        if got_rows != rows or widths != {width}:
                            raise HarnessError(f"engine bench: {v} returned {got_rows} rows of width {widths}, "
                                               f"expected {rows} of {width}")
                        digests[v].add("".join(o["hidden_sha256"] for o in outs))
                    if r == 0:
                        continue  # warm-up
                    samples.append({"variant": v, "round": r, "seconds": s.last_generate_s, "rows": got_rows})
                print(f"[bench] round {r}{' (warm-up)' if r == 0 else ''}: "
                      + ", ".join(f"{v} {sessions[v].last_generate_s:.3f} s" for v in rotation(r)), flush=True)
            rss = {v: {k_: v_ for k_, v_ in sessions[v].rss().items() if k_ != "ok"} for v in VARIANTS}
        finally:
            for s in sessions.values():
                if s.proc is not None and s.current is not None:
                    try:
                        s.resume()  # a stopped Engine cannot shut down
                    except Exception:  # noqa: BLE001 - close() kills the group anyway
                        pass
                s.close()
        provenance = {v: check_provenance(v, read_provenance(root / "provenance" / v), pristine) for v in VARIANTS}
    same = ("yes (identical rows, sha256 of float32 bytes)"
            if digests["pristine"] == digests["series"] and len(digests["series"]) == 1
            else f"NO: pristine {len(digests['pristine'])} digest(s), series {len(digests['series'])}, differ")
    report = {
        "meta": {"base": base, "cores": os.cpu_count(), "family": "llama", "hidden": args.engine_hidden,
                 "layers": args.engine_layers, "k": k, "layer_ids": list(ids), "width": width,
                 "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "rows": rows, "rounds": args.rounds, "torch": torch.__version__,
                 "wall_s": round(time.monotonic() - t_start, 1)},
        "summary": summarize(samples, rows, width),
        "samples": samples,
        "rss": rss,
        "same_features": same,
        "provenance": provenance,
    }
    out = lay.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (out / "engine.md").write_text(md)
    print(md)
    print(f"[bench] wrote {lay.rel(out / 'engine.json')} and engine.md ({report['meta']['wall_s']} s)")
    return 0
