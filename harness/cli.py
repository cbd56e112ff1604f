"""Command-line entry point: ``python -m harness VERB ...``.

Each verb lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``. The Makefile and tox only call these verbs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from harness import HarnessError

# verb -> (module, help)
COMMANDS = {
    "apply-patches": ("harness.patchset.apply", "fetch + verify the pin, apply the series to build/sglang"),
    "export-patches": ("harness.patchset.export", "regenerate patches/ from the commits in build/sglang"),
    "check-patches": ("harness.patchset.check", "lint the series and metadata, zero-fuzz apply, round trip, style"),
    "build-wheel": ("harness.patchset.wheel", "build the patched, installable sglang wheel into build/dist"),
    "install-wheel": ("harness.patchset.install", "install the patched wheel into the running interpreter's env"),
    "lock": ("harness.patchset.lock", "re-resolve requirements/test.lock with uv (hashes, pinned)"),
    "test": ("harness.suites.test", "run the CPU suites with pytest-xdist"),
    "test-gpu": ("harness.suites.gpu", "run the suites on CUDA/NCCL"),
    "e2e": ("harness.suites.e2e", "the real-engine tier: SGLang's own Engine on the CPU (tests/e2e)"),
    "ablation": ("harness.suites.ablation", "run each regression test without its patch (must fail) and with it"),
    "bench": ("harness.memory.bench", "memory benchmark: list+cat vs packer (--engine: capture cost in the Engine)"),
    "bench-suite": ("harness.suites.budget", "time the suites (and the ablation); count SGLang imports"),
    "docker-base": ("harness.docker.base", "build the Debian base image locally (debootstrap)"),
    "docker-test": ("harness.docker.image", "build the CPU image and run the suites inside"),
    "upstream-status": ("harness.upstream.status", "which patches later SGLang releases already carry"),
    "rebase": ("harness.upstream.rebase", "move the pin to another release and re-apply the series"),
    "pr-export": ("harness.upstream.prexport", "write an upstream PR bundle per upstream-bound patch"),
    "doctor": ("harness.doctor.run", "which features a draft was trained on, and whether this server feeds them"),
    "doctor-demo": ("harness.doctor.demo", "the doctor on tiny checkpoints with planted conventions"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text, allow_abbrev=False)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_missing=module_name)
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _passthrough=getattr(module, "PASSTHROUGH", False))
    return parser


def main(argv: list[str] | None = None) -> int:
    from harness.patchset.scratch import Terminated, unwind_on_signals

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # A verb with PASSTHROUGH hands what it does not know to the tool it wraps (pytest).
    args.passthrough = extra[1:] if extra[:1] == ["--"] else extra
    if getattr(args, "_missing", None):
        print(f"error: {args.verb}: not implemented ({args._missing} missing)", file=sys.stderr)
        return 2
    try:
        with unwind_on_signals():  # SIGTERM/SIGHUP unwind like Ctrl-C: scratch trees go
            return int(args._run(args) or 0)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Terminated as exc:
        print(f"error: {args.verb}: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
