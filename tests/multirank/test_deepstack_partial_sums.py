"""Qwen3.5 deepstack where a layer defers its all-reduce (survey bug "V").

qwen3_5's language model adds deepstack features after each of its first three layers.
Its layers defer their MLP all-reduce into the next layer's fused norm at TP > 1, so a
layer's ``hidden_states`` is this rank's partial sum: features added there are summed
once per rank. (transformers' Qwen3.5 has no deepstack path: this is a cross-TP check,
the HF-checked Qwen3-VL deepstack is tests/parity/test_deepstack.py.) With the features
on every token, TP = 2 with FlashInfer fusion must equal TP = 1 exactly (small integers,
float64), in the final hidden states and in every capture.
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

MODELS = ("qwen3_5", "qwen3_5_moe")


def _params():
    for name in MODELS:
        spec = specs()[name]
        patch = spec.patch_for("V") if "V" in spec.bugs() else None
        marks = [pytest.mark.multirank, pytest.mark.world_size(2)]
        marks += [pytest.mark.guards(patch)] if patch else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_params()))
def test_deepstack_is_added_once_under_fused_all_reduce(sglang_tp1, rank_pool, name):
    from harness.suites.models import deepstack_case

    layers = layer_sets(specs()[name].tiny.num_layers)["dflash"]
    ref = deepstack_case(0, 1, model=name, layers_to_capture=layers)
    for res in rank_pool(2).run("harness.suites.models:deepstack_case", model=name,
                                layers_to_capture=layers, fusion="flashinfer"):
        r = res["rank"]
        assert torch.equal(res["final"], ref["final"]), (
            f"rank {r}: final hidden states differ from TP=1 with deepstack (max abs diff "
            f"{(res['final'] - ref['final']).abs().max().item()})")
        assert torch.equal(res["captures"], ref["captures"]), (
            f"rank {r}: captures differ from TP=1 with deepstack")
