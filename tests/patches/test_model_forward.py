"""Every capturing model of the pin at TP = 1, in this worker (docs/MODELS.md).

- it returns its captures packed into one ``[tokens, K * hidden]`` tensor
  (patch models-aux-packer), equal to the TP = 1 reference;
- an idle batch (zero tokens) still gives K of K, including the last layer
  (patch models-capture-final-layer);
- its real ``XModel.forward`` traces with ``torch.compile(fullgraph=True)`` (what
  SGLang's piecewise CUDA graph does on CUDA; ``backend="eager"`` here) with in-loop
  and last-layer captures, and the compiled forward gives the eager result.
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

NAMES = sorted(specs())


def _guarded(bug: str, patch: str):
    return [
        pytest.param(
            n,
            marks=[pytest.mark.guards(specs()[n].patch_for(bug, patch))] if bug in specs()[n].bugs() else [],
        )
        for n in NAMES
    ]


@pytest.mark.parametrize("name", _guarded("B", "models-aux-packer"))
def test_returns_packed_captures(sglang_tp1, name):
    spec = specs()[name]
    res = capture_case(0, 1, model=name, layers_to_capture=layer_sets(spec.tiny.num_layers)["eagle3-default"])
    assert res["returned_packed"], f"{name} returned its captures as a list, not one packed tensor"
    assert res["captures"].shape == res["expected"].shape
    assert torch.equal(res["captures"], res["expected"])


@pytest.mark.parametrize("name", _guarded("C", "models-capture-final-layer"))
def test_idle_batch_captures_k_of_k(sglang_tp1, name):
    spec = specs()[name]
    layers = layer_sets(spec.tiny.num_layers)["eagle3-last"]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, num_tokens=0, mode="idle")
    assert res["num_captured"] == len(layers), (
        f"{name}: captured {res['num_captured']} of {len(layers)} on an idle batch"
    )
    assert tuple(res["captures"].shape) == (0, len(layers) * spec.tiny.hidden_size)


@pytest.mark.parametrize("name", NAMES)
def test_forward_traces_fullgraph(sglang_tp1, name):
    from harness.suites.models import compiled_matches_eager

    eager, compiled = compiled_matches_eager(name, layer_sets(specs()[name].tiny.num_layers)["eagle3-last"])
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c), f"{name}: compiled forward differs from eager"
