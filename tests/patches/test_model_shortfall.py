"""No silent shortfall under two-batch overlap (the pin's models-capture-no-shortfall,
0.5.23's models-capture-skips-tbo): a batch that can run TBO still gives K of K
captures equal to the reference.

The models whose forward sends layers through the TBO executor (survey bug "T":
``model_forward_maybe_tbo`` on the pin, ``model_forward_stages`` on 0.5.23). The TBO executor is a sequential CPU stand-in: the same layers and math and, like
SGLang's operation strategies, no captures, so without the patch the captures of those
layers are missing (or the model returns none at all).
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

TBO_MODELS = sorted(n for n, s in specs().items() if "T" in s.bugs())


@pytest.mark.parametrize("layers_name", ["eagle3-default", "dflash"])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.guards(specs()[n].patch_for("T"))) for n in TBO_MODELS]
)
def test_two_batch_overlap_batch_captures_k_of_k(sglang_tp1, name, layers_name):
    layers = layer_sets(specs()[name].tiny.num_layers)[layers_name]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, tbo=True)
    assert res["num_captured"] == res["num_expected"], (
        f"{name}: captured {res['num_captured']} of {res['num_expected']} aux hidden states "
        f"in a batch that can run two-batch overlap ({res['tbo_layers']} layers overlapped)"
    )
    assert torch.equal(res["captures"], res["expected"])
    assert torch.equal(res["final"], res["reference_final"])
    assert res["tbo_layers"] == 0


def test_tbo_models_are_covered():
    assert {"deepseek_v2", "glm4_moe", "glm4_moe_lite", "qwen2_moe", "qwen3_moe", "minimax_m2"} <= set(TBO_MODELS)


@pytest.mark.parametrize("name", TBO_MODELS)
def test_two_batch_overlap_still_runs_when_nothing_is_captured(sglang_tp1, name):
    from harness.suites.models import _forward, _tbo_executor, get_model, input_ids

    model = get_model(name)
    calls: list = []
    specs()[name].configure(model, [])
    with _tbo_executor(model, calls, enabled=True):
        _forward(model, input_ids(6, specs()[name].tiny.vocab_size), tbo=True)
    assert sum(calls) > 0, f"{name}: a batch that captures nothing no longer overlaps"
