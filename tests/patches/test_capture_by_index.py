"""The models that flagged layers capture by ``layers_to_capture`` alone.

qwen2_moe (also run by qwen3_moe), qwen3_next and qwen3_5 kept two records of what
to capture: their setters set the list and flagged each layer, and the forward
captured in the loop by the flags but the last layer by the list. The Qwen3-VL wrapper
that real Qwen3.5 checkpoints are served through sets only its language model's list
(``Qwen3VLForConditionalGeneration.set_eagle3_layers_to_capture``). Here every such
model gets its captures requested that way: the list alone, no flag. Each must return
K of K, equal to the reference (the layers' complete outputs, taken with hooks).
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _params():
    out = []
    for name, spec in sorted(specs().items()):
        if "L" not in spec.bugs():
            continue
        patch = spec.patch_for("L")
        marks = [pytest.mark.guards(patch)] if patch else [
            pytest.mark.skip(reason="bug 'L' is not fixed by this base's series (docs/MODELS.md)")]
        for set_name in ("eagle3-default", "eagle3-last"):
            out.append(pytest.param(name, set_name, id=f"{name}-{set_name}", marks=marks))
    return out


@pytest.mark.parametrize("name, set_name", _params())
def test_list_alone_captures_k_of_k(sglang_tp1, name, set_name):
    spec = specs()[name]
    layers = layer_sets(spec.tiny.num_layers)[set_name]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, list_only=True)
    assert res["num_captured"] == res["num_expected"], (
        f"{name}: layers_to_capture={layers} set alone gave {res['num_captured']} of "
        f"{res['num_expected']} aux hidden states"
    )
    assert torch.equal(res["captures"], res["expected"]), (
        f"{name}: captures differ from the layers' outputs"
    )
