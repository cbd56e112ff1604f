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
    "apply-patches": ("harness.patchset", "fetch + verify the pin, apply the series to build/sglang"),
    "export-patches": ("harness.export", "regenerate patches/ from the commits in build/sglang"),
    "check-patches": ("harness.check", "lint the series and metadata, zero-fuzz apply, round trip, style"),
    "build-wheel": ("harness.build", "build the patched, installable sglang wheel into build/dist"),
    "install-wheel": ("harness.build_install", "install the patched wheel into the running interpreter's env"),
    "lock": ("harness.lock", "re-resolve requirements/test.lock with uv (hashes, pinned)"),
    "test": ("harness.testcmd", "run the CPU suites with pytest-xdist"),
    "test-gpu": ("harness.testcmd_gpu", "run the suites on CUDA/NCCL"),
    "ablation": ("harness.ablation", "run each regression test without its patch (must fail) and with it"),
    "bench": ("harness.bench", "memory benchmark: list+cat vs packer"),
    "docker-base": ("harness.docker", "build the Debian base image locally (debootstrap)"),
    "docker-test": ("harness.docker_test", "build the CPU image and run the suites inside"),
    "upstream-status": ("harness.upstream", "which patches later SGLang releases already carry"),
    "rebase": ("harness.rebase", "move the pin to another release and re-apply the series"),
    "pr-export": ("harness.prexport", "write an upstream PR bundle per upstream-bound patch"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_missing=module_name)
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"error: {args.verb}: not implemented ({args._missing} missing)", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
