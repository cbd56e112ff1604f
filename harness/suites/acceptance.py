"""GPU checks of the upstream bundles: a named model served by SGLang's own server, on
the pristine release and with the series, side by side (``test-gpu --acceptance``,
``ci/gpu-acceptance.sh``).

Each check (:data:`CHECKS`) is one target, with a published draft where one exists:

* a draft check launches ``python3 -m sglang.launch_server`` with the draft, runs
  ``python3 -m sglang.bench_serving`` on ShareGPT (``--dataset-path``: the machine is
  offline; ``SHAREGPT`` names the file), and reads ``avg_spec_accept_length`` and
  ``memory_usage`` from ``/get_server_info``: the acceptance length must not move
  (within ``ACCEPT_TOLERANCE``), the memory is reported beside it;
* a return-aux check (no draft: the features a trainer reads) launches the server with
  ``--enable-return-aux-hidden-states`` and sends the same prompts to ``/generate``
  with ``return_hidden_states``: the rows must be the pristine release's, value for value
  (sha256 of their float32 bytes), and their rows/s is reported.

:data:`BUNDLE_CHECKS` says, for every bundle that ``pr-export`` writes, which checks prove
it on a GPU, or why none does (a refusal or a warning changes no value; a layout that
needs more than one GPU). :func:`commands` is what a bundle's body prints: the same
command lines this module runs. On a machine without a GPU the check prepares what it
can (the pristine tree, the command lines, the report directory) and stops with one
line saying that it needs a CUDA device from there on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from harness import HarnessError

# The acceptance length may move by this share of pristine's and still be "unchanged"
# (greedy decoding; batch composition can move a verify by a token).
ACCEPT_TOLERANCE = 0.02
PORT = 30017
SPEC_314 = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    target: str
    draft: str | None
    server_args: tuple[str, ...]
    why: str

    @property
    def kind(self) -> str:
        return "draft" if self.draft else "return-aux"

    def launch(self, port: int = PORT) -> list[str]:
        cmd = ["python3", "-m", "sglang.launch_server", "--model-path", self.target]
        if self.draft:
            cmd += ["--speculative-draft-model-path", self.draft]
        return cmd + list(self.server_args) + ["--mem-fraction-static", "0.8", "--port", str(port)]

    def bench(self, port: int = PORT, dataset: str = "$SHAREGPT", out: str = "bench.jsonl") -> list[str]:
        return ["python3", "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port),
                "--dataset-name", "sharegpt", "--dataset-path", dataset, "--num-prompts", "80",
                "--max-concurrency", "8", "--sharegpt-output-len", "256", "--seed", "1",
                "--output-file", out]


CHECKS = {c.name: c for c in (
    Check("llama-eagle3", "meta-llama/Llama-3.1-8B-Instruct",
          "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge",
          ("--speculative-algorithm", "EAGLE3", *SPEC_314),
          "LlamaModel (one plain layer loop) under an EAGLE3 draft: its captures, packed, and "
          "the draft's own capture handed on"),
    Check("qwen3-dflash", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16",
          ("--speculative-algorithm", "DFLASH"),
          "Qwen3Model under a DFlash draft (five layer ids, DFlash's meaning)"),
    Check("qwen3-moe-eagle3", "Qwen/Qwen3-30B-A3B-Instruct-2507",
          "lmsys/SGLang-EAGLE3-Qwen3-30B-A3B-Instruct-2507-SpecForge-Nex",
          ("--speculative-algorithm", "EAGLE3", *SPEC_314),
          "Qwen3MoeModel (flag-based capture, layers that defer their all-reduce)"),
    Check("llama-return-aux", "meta-llama/Llama-3.1-8B-Instruct", None,
          ("--enable-return-aux-hidden-states", "--disable-radix-cache"),
          "the features a trainer collects from LlamaModel, and their trip to the caller"),
    Check("llama-return-aux-chunked", "meta-llama/Llama-3.1-8B-Instruct", None,
          ("--enable-return-aux-hidden-states", "--disable-radix-cache",
           "--chunked-prefill-size", "128"),
          "the features of prompts longer than one prefill chunk"),
    Check("qwen3-vl-return-aux", "Qwen/Qwen3-VL-8B-Instruct", None,
          ("--enable-return-aux-hidden-states", "--disable-radix-cache"),
          "Qwen3-VL's features next to its deepstack, unset setting (text prompts: the "
          "deepstack rows need an image, which the CPU tier checks against transformers)"),
    Check("lfm2-return-aux", "LiquidAI/LFM2-1.2B", None,
          ("--enable-return-aux-hidden-states", "--disable-radix-cache"),
          "a hybrid (short-convolution) stack's features, packed"),
)}

# Per bundle: the checks that prove it on a GPU, or why none does.
BUNDLE_CHECKS: dict[str, tuple[str, ...] | str] = {
    # Its two-batch-overlap part needs DP attention over two GPUs or more.
    "models-capture-final-layer": ("llama-eagle3", "qwen3-dflash", "qwen3-moe-eagle3"),
    "gemma3-capture-layer-output": "no published Gemma 3 EAGLE3 draft is named in sgl-project/sglang#39286; "
                                   "the CPU tier checks the value against transformers",
    "capture-gather-scattered": "attention-TP input scattering needs TP 2 or more (DeepSeek with q-lora)",
    "models-capture-setters": ("llama-eagle3", "qwen3-dflash"),
    "aux-packer-infra": ("llama-eagle3",),
    # Its DeepSeek-V3 / MiMo-V2 part (the decode graph's shared buffer) needs more than one
    # GPU for those targets.
    "aux-packer-plain-loops": ("llama-eagle3", "qwen3-dflash", "qwen3-moe-eagle3", "qwen3-vl-return-aux"),
    "aux-packer-fused-loops": "no published draft for a Nanbeige, Inkling, Beam or MuseSpark target; "
                              "the CPU tier checks their packed values",
    # Its Kimi pipeline-stage part needs PP 2 or more.
    "aux-packer-hybrid-stacks": ("lfm2-return-aux",),
    "capture-ids-checked": "refuses bad ids at start-up; changes no value or memory",
    # Beam's post_norm has no published draft; the start-up warning changes nothing.
    "final-layer-capture": ("llama-eagle3", "llama-return-aux", "qwen3-vl-return-aux"),
    "return-aux-chunked-prefill-rows": ("llama-return-aux-chunked",),
    "qwen4-exp-refuses-captures": "a refusal; changes no value or memory",
    "glm5-next-mhc-eagle3-last-refused": "a refusal; changes no value or memory",
    "aux-hidden-state-list-deprecated": ("llama-eagle3",),
    "return-hidden-states-arrays": ("llama-return-aux",),
}


def checks_of(bundle: str) -> tuple[Check, ...]:
    entry = BUNDLE_CHECKS.get(bundle)
    if not isinstance(entry, tuple):
        return ()
    return tuple(CHECKS[n] for n in entry)


def commands(check: Check, release: str) -> list[str]:
    """The check as a reviewer runs it: the same command lines, on v<release> and with
    the change."""
    lines = [shlex.join(check.launch())]
    if check.draft:
        lines.append(shlex.join(check.bench(out="bench.jsonl")))
        lines.append(f"curl -s localhost:{PORT}/get_server_info  # avg_spec_accept_length, memory_usage")
    else:
        lines.append(f"curl -s localhost:{PORT}/generate -d '{{\"text\": \"...\", "
                     "\"return_hidden_states\": true, \"sampling_params\": {\"temperature\": 0, "
                     "\"max_new_tokens\": 64}}'  # meta_info.hidden_states")
    return lines


def body_lines(bundle: str, release: str) -> list[str]:
    """A bundle body's GPU check paragraph."""
    entry = BUNDLE_CHECKS.get(bundle)
    if entry is None:
        return []
    if isinstance(entry, str):
        return [f"GPU check: none on one GPU ({entry}).", ""]
    out = ["GPU check (one GPU; run on v" + release + " and with this change, side by side):", ""]
    for c in checks_of(bundle):
        what = ("acceptance length unchanged, `memory_usage` beside it" if c.draft
                else "the returned rows identical, value for value, their rows/s beside them")
        out += [f"- {c.target}" + (f" with {c.draft}" if c.draft else "") + f": {what} ({c.why}).",
                "", "```", *commands(c, release), "```", ""]
    return out


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _weights(repo: str) -> Path | None:
    """The local snapshot of ``repo`` (the GPU machines are offline)."""
    if Path(repo).is_dir():
        return Path(repo)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or no hub client: the caller says so
        return None


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 1200.0) -> None:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise HarnessError(f"sglang.launch_server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(5)
    raise HarnessError(f"sglang.launch_server not healthy after {timeout:.0f} s")


def _get(port: int, path: str, payload: dict | None = None) -> Any:
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a Python function that merges two sorted lists.",
    "Summarise the causes of the French Revolution in five sentences.",
    "What is the difference between a process and a thread?",
    "Translate 'the weather is nice today' into French, German and Spanish.",
    "List three ways to reduce memory use when training a neural network.",
    "Describe the rules of chess for the knight and the bishop.",
    "Why do prime numbers matter in cryptography?",
]


def features_digest(rows: Sequence[Any]) -> str:
    """sha256 of the rows as float32 bytes, in request order."""
    import numpy as np

    h = hashlib.sha256()
    for r in rows:
        h.update(np.asarray(r, dtype=np.float32).tobytes())
    return h.hexdigest()


def accept_unchanged(pristine: float | None, series: float | None) -> bool:
    if pristine is None or series is None:
        return False
    return abs(series - pristine) <= ACCEPT_TOLERANCE * pristine


def _serve(check: Check, variant: str, env: dict[str, str], out: Path, dataset: str | None) -> dict:
    log = (out / f"{variant}-server.log").open("w")
    proc = subprocess.Popen(check.launch(), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_healthy(PORT, proc)
        t0 = time.monotonic()
        result: dict[str, Any] = {"variant": variant}
        if check.draft:
            subprocess.run(check.bench(dataset=dataset or "", out=str(out / f"{variant}-bench.jsonl")),
                           env=env, check=True)
            state = _get(PORT, "/get_server_info")["internal_states"][0]
            result.update(accept_length=state.get("avg_spec_accept_length"),
                          memory_usage=state.get("memory_usage"))
        else:
            rows = []
            for p in PROMPTS:
                got = _get(PORT, "/generate", {"text": p, "return_hidden_states": True,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 64}})
                rows += [r for step in got["meta_info"]["hidden_states"] for r in step]
            dt = time.monotonic() - t0
            state = _get(PORT, "/get_server_info")["internal_states"][0]
            result.update(rows=len(rows), rows_per_s=len(rows) / dt, digest=features_digest(rows),
                          memory_usage=state.get("memory_usage"))
        return result
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def verdict(check: Check, pristine: dict, series: dict) -> tuple[bool, str]:
    """Whether the series kept what the check guards, and the line that says so."""
    if check.draft:
        ok = accept_unchanged(pristine.get("accept_length"), series.get("accept_length"))
        return ok, (f"accept length {pristine.get('accept_length')} -> {series.get('accept_length')} "
                    f"({'unchanged' if ok else 'CHANGED'}); memory_usage {pristine.get('memory_usage')} -> "
                    f"{series.get('memory_usage')}")
    ok = pristine.get("digest") == series.get("digest") and pristine.get("rows") == series.get("rows")
    return ok, (f"{series.get('rows')} rows, {'identical' if ok else 'DIFFERENT'}; rows/s "
                f"{pristine.get('rows_per_s', 0):.0f} -> {series.get('rows_per_s', 0):.0f}")


def run_checks(lay, names: Sequence[str], *, skip_missing: bool = False) -> int:
    """Every named check (``all``: every one), pristine then series; a report in
    ``<results>/gpu-acceptance/``. Stops in one line where it needs a GPU it does not have,
    or weights the machine does not hold (``skip_missing``: says so and goes on, as
    ``test-gpu`` does after its suites)."""
    from harness.e2e.bench import pristine_tree
    from harness.patchset.pin import base_tag, load_pin

    wanted = list(CHECKS) if list(names) == ["all"] else list(names)
    unknown = [n for n in wanted if n not in CHECKS]
    if unknown:
        raise HarnessError(f"unknown GPU check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    release = load_pin(lay)["version"]
    pristine = pristine_tree(lay, base_tag(load_pin(lay)))
    out = lay.results / "gpu-acceptance"
    out.mkdir(parents=True, exist_ok=True)
    (out / "commands.txt").write_text("".join(
        f"# {n}\n" + "\n".join(commands(CHECKS[n], release)) + "\n" for n in wanted))
    if _gpu_count() == 0:
        raise HarnessError(
            f"GPU check {', '.join(wanted)}: prepared ({lay.rel(out)}/commands.txt, pristine "
            f"{lay.rel(pristine)}); needs a CUDA device from here on (torch.cuda.is_available() "
            f"is False): it serves {CHECKS[wanted[0]].target}")
    dataset = os.environ.get("SHAREGPT")
    report, failed = [], []
    for n in wanted:
        c = CHECKS[n]
        missing = [r for r in (c.target, c.draft) if r and _weights(r) is None]
        if missing and skip_missing:
            print(f"[gpu-check] {n}: skipped ({', '.join(missing)} not on this machine)", flush=True)
            continue
        if missing:
            raise HarnessError(f"GPU check {n}: {', '.join(missing)} not on this machine "
                               "(offline: put it in the Hugging Face cache first)")
        if c.draft and not (dataset and Path(dataset).is_file()):
            raise HarnessError(f"GPU check {n}: SHAREGPT must name a local ShareGPT json (offline)")
        d = out / n
        d.mkdir(exist_ok=True)
        env_series = dict(os.environ, HF_HUB_OFFLINE="1")
        env_pristine = dict(env_series, PYTHONPATH=os.pathsep.join(
            [str(pristine)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        runs = {v: _serve(c, v, env, d, dataset)
                for v, env in (("pristine", env_pristine), ("series", env_series))}
        ok, line = verdict(c, runs["pristine"], runs["series"])
        print(f"[gpu-check] {n}: {line}", flush=True)
        report.append({"check": n, "ok": ok, "line": line, **runs})
        if not ok:
            failed.append(n)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        raise HarnessError(f"GPU check(s) failed: {', '.join(failed)} (see {lay.rel(out)}/report.json)")
    return 0

