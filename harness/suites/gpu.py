"""``test-gpu``: the same suites on CUDA with NCCL and the real kernels.

On a CUDA machine the CPU stand-ins switch off: RMSNorm runs SGLang's CUDA
``fused_add_rmsnorm``, the FlashInfer fusion case runs FlashInfer's real fused
all-reduce + residual + RMSNorm (where SGLang's own predicate allows it: sm90/sm100,
flashinfer present), ranks use NCCL on ``cuda:<rank>``, and memory is the CUDA
allocator's peak after a warm-up. Attention and MLP stay the TP-sharded stand-ins (no
model weights are loaded). Multi-rank cases need one GPU per rank and skip with a
reason otherwise, so on a single GPU this runs the TP = 1 model cases and the memory
suite. The model runs in float32 there (exact for these small integers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from harness import HarnessError
from harness.patchset.layout import layout

GPU_SUITES = [
    "tests/patches/test_final_layer.py",
    "tests/patches/test_deepseek_capture.py",
    "tests/memory/test_capture_memory.py",
    "tests/multirank",
]


# Arguments this verb does not know go to pytest, in order (`make test ARGS='-k comm'`).
PASSTHROUGH = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--acceptance``: the bundles' GPU checks alone (``harness.suites.acceptance``);
    every other argument goes to pytest."""
    p.add_argument("--acceptance", nargs="+", metavar="CHECK",
                   help="run these GPU checks (pristine vs series; 'all' for every one) "
                        "instead of the suites")


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(args: argparse.Namespace) -> int:
    if args.acceptance:
        from harness.suites.acceptance import run_checks

        return run_checks(layout(), args.acceptance)
    n = gpu_count()
    if n == 0:
        raise HarnessError(
            "test-gpu needs an NVIDIA GPU: torch.cuda.is_available() is False on this machine "
            "(run `make test` for the CPU suites, or `docker run --gpus all ...`)"
        )
    lay = layout()
    extra = args.passthrough
    results = lay.results
    results.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HARNESS_DEVICE="cuda", HARNESS_DIST_BACKEND="nccl")
    # One worker: ranks of a TP=4 pool already take four GPUs.
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "0",
           "--junitxml", str(results / "junit-gpu.xml")] + (extra or GPU_SUITES)
    print(f"[test-gpu] {n} GPU(s) visible; multi-rank cases need one GPU per rank", flush=True)
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=lay.root, env=env).returncode
    if extra:
        return rc
    # Then the bundles' GPU checks whose weights this machine holds.
    from harness.suites.acceptance import run_checks

    try:
        run_checks(lay, ["all"], skip_missing=True)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return rc or 1
    return rc
