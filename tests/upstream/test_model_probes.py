"""The model-wide probes read real sources: the pristine pin wheel says absent, the
installed patched build says present, for every patch of the model-wide series."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.patchset.layout import layout
from harness.patchset.pin import load_pin, pin_wheel
from harness.upstream.probes import DirTree, ZipTree, run_probes

IDS = [
    "models-capture-after-allreduce",
    "models-aux-packer",
    "qwen3-next-last-layer-allreduce",
    "models-capture-final-layer",
    "models-capture-no-shortfall",
]


def _pin_wheel() -> Path:
    lay = layout()
    path = lay.cache / pin_wheel(load_pin(lay))[0]
    if not path.exists():
        pytest.skip(f"{path} not downloaded (run make apply-patches)")
    return path


def _patched_tree() -> DirTree:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("no sglang installed")
    tree = DirTree(Path(spec.origin).parent.parent)
    if "auxcap" not in (tree.read("sglang/_version.py") or ""):
        pytest.skip("the installed sglang is not the patched build")
    return tree


def test_absent_at_the_pin():
    tree = ZipTree(_pin_wheel())
    try:
        results = run_probes(tree, IDS)
    finally:
        tree.close()
    assert [r.found for r in results] == [False] * len(IDS), [r.to_json() for r in results]


def test_present_on_the_patched_build():
    results = run_probes(_patched_tree(), IDS)
    assert [r.found for r in results] == [True] * len(IDS), [r.to_json() for r in results]
