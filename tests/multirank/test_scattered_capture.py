"""Captures cover every token when the layer input is scattered across the TP group
(patch capture-gather-scattered): attention-TP input scattering through SGLang's own
AttnTpContext on the real DeepseekV2Model.forward, and a scattered-input (a2a MoE)
layer under SGLANG_USE_AG_AFTER_QLORA."""

from __future__ import annotations

import pytest
import torch

from harness.suites.capture import capture_matrix, layer_sets

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

GUARD = pytest.mark.guards("capture-gather-scattered")
NUM_LAYERS = 8
TOKENS = 8  # divisible by every TP size: input scattering splits tokens evenly
CASES = [
    dict(num_tokens=TOKENS, layers_to_capture=layers, fusion="off", collector_kind=kind,
         input_scattered=True)
    for layers in (layer_sets(NUM_LAYERS)["eagle3-default"], layer_sets(NUM_LAYERS)["dflash"])
    for kind in ("list", "packer")
]
IDS = [f"{name}-{kind}" for name in ("eagle3-default", "dflash") for kind in ("list", "packer")]
_RESULTS: dict = {}


@pytest.fixture(scope="module")
def tp1_reference(sglang_tp1):
    return capture_matrix(0, 1, CASES)


@GUARD
@pytest.mark.multirank
@pytest.mark.parametrize(
    "tp", [pytest.param(tp, marks=pytest.mark.world_size(tp)) for tp in (2, 4)]
)
@pytest.mark.parametrize("idx", range(len(CASES)), ids=IDS)
def test_input_scattered_captures_match_tp1_reference(rank_pool, tp1_reference, tp, idx):
    if tp not in _RESULTS:
        _RESULTS[tp] = rank_pool(tp, timeout=900).run(
            "harness.suites.capture:capture_matrix", CASES
        )
    ref = tp1_reference[idx]
    for per_rank in _RESULTS[tp]:
        res = per_rank[idx]
        assert "error" not in res, f"rank {res['rank']} raised:\n{res.get('error')}"
        assert res["captures"].shape == ref["expected"].shape, (
            f"rank {res['rank']}: captures {tuple(res['captures'].shape)}, expected "
            f"{tuple(ref['expected'].shape)} (every token of the batch)"
        )
        assert torch.equal(res["captures"], ref["expected"]), (
            f"rank {res['rank']}: captures differ from the TP=1 reference"
        )
        assert torch.equal(res["final"], ref["reference_final"])


@GUARD
@pytest.mark.multirank
@pytest.mark.world_size(2)
def test_ag_after_qlora_scattered_input_capture_is_gathered(rank_pool):
    results = rank_pool(2, timeout=900).run("harness.suites.capture:ag_after_qlora_capture")
    for rank, res in enumerate(results):
        # attention keeps its scattered input (it gathers after q_lora) ...
        assert res["attn_input_rows"] == 3
        # ... but the capture covers every token of the attention TP group
        assert res["captured"].shape == res["expected"].shape, (
            f"rank {rank}: captured {tuple(res['captured'].shape)}, expected "
            f"{tuple(res['expected'].shape)}"
        )
        assert torch.equal(res["captured"], res["expected"])
