"""Aux captures at TP = 1, 2, 4 over gloo, through SGLang's own GroupCoordinator.

Matrix: TP x fusion (off / FlashInfer-fused: fresh residual_out / aiter-like:
in place) x collector (list / packer) x layers_to_capture (EAGLE3 default, EAGLE3
ids including the last layer, DFlash-style ids). Each TP runs the whole matrix in
one call through a warm rank pool; the TP = 1 reference runs in this worker.

Every rank's captures must equal the TP = 1 reference exactly (integer-valued
float64 makes the all-reduce order-independent) and each other; K of K are
captured; no list capture changes after it was taken; no capture shares storage
with the final hidden states; the final hidden states are unchanged by capturing.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.suites.capture import capture_matrix, layer_sets

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

NUM_LAYERS = 8
TOKENS = 6
FUSIONS = ["off", "flashinfer", "aiter"]
COLLECTORS = ["list", "packer"]
LAYER_SETS = layer_sets(NUM_LAYERS)
CASES = [
    dict(num_tokens=TOKENS, layers_to_capture=layers, fusion=fusion, collector_kind=kind)
    for (name, layers), fusion, kind in itertools.product(LAYER_SETS.items(), FUSIONS, COLLECTORS)
]
CASE_IDS = [
    f"{name}-{fusion}-{kind}"
    for name, fusion, kind in itertools.product(LAYER_SETS, FUSIONS, COLLECTORS)
]

_RESULTS: dict = {}


@pytest.fixture(scope="module")
def tp1_reference(sglang_tp1):
    return capture_matrix(0, 1, CASES)


def _results(rank_pool, tp):
    if tp not in _RESULTS:
        pool = rank_pool(tp, timeout=900)
        _RESULTS[tp] = pool.run("harness.suites.capture:capture_matrix", CASES)
    return _RESULTS[tp]


def _params():
    for tp in (1, 2, 4):
        for idx, case_id in enumerate(CASE_IDS):
            case = CASES[idx]
            marks = [pytest.mark.multirank] + ([pytest.mark.world_size(tp)] if tp > 1 else [])
            with_last = NUM_LAYERS in case["layers_to_capture"]
            # Guards only where the missing patch is the reason for failing: without
            # 0002 the fused cases capture per-rank partial sums; the cases that also
            # capture the last layer would fail for 0004's reason as well.
            if tp > 1 and case["fusion"] != "off" and not with_last:
                marks.append(pytest.mark.guards("dsv2-capture-after-allreduce"))
            if with_last:
                marks.append(pytest.mark.guards("dsv2-capture-final-layer"))
            yield pytest.param(tp, idx, id=f"tp{tp}-{case_id}", marks=marks)


@pytest.mark.parametrize("tp, idx", list(_params()))
def test_captures_match_tp1_reference(rank_pool, tp1_reference, tp, idx):
    case = CASES[idx]
    ref = tp1_reference[idx]
    assert "error" not in ref, ref.get("error")
    per_rank = [r[idx] for r in _results(rank_pool, tp)] if tp > 1 else [ref]
    for res in per_rank:
        assert "error" not in res, f"rank {res['rank']} raised:\n{res.get('error')}"
    want_k = ref["num_expected"]
    for res in per_rank:
        r = res["rank"]
        assert res["num_captured"] == want_k, (
            f"rank {r}: captured {res['num_captured']} of {want_k} aux hidden states"
        )
        assert torch.equal(res["captures"], ref["expected"]), (
            f"rank {r}: captures differ from the TP=1 reference "
            f"(max abs diff {(res['captures'] - ref['expected']).abs().max().item()})"
        )
        assert torch.equal(res["final"], ref["reference_final"]), (
            f"rank {r}: capturing changed the final hidden states"
        )
        if case["collector_kind"] == "list":
            assert res["changed_after_capture"] == [], (
                f"rank {r}: captures {res['changed_after_capture']} were modified by later layers"
            )
        assert res["shares_storage_with_final"] == [], (
            f"rank {r}: captures {res['shares_storage_with_final']} share storage with the "
            "final hidden states"
        )
    for res in per_rank[1:]:
        assert torch.equal(res["captures"], per_rank[0]["captures"]), (
            f"rank {res['rank']} and rank 0 captured different tensors"
        )
