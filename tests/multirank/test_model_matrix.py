"""Every capturing model of the pin at TP = 1, 2, 4 over gloo (docs/MODELS.md).

For each model spec (harness/standins/models): the real ``XModel.forward`` and
decoder layers, attention and MLP/MoE as exact TP-sharded stand-ins, x fusion (off,
and FlashInfer-fused / aiter-like in place where the model's layers defer their
all-reduce) x layer sets (EAGLE3 default, EAGLE3 ids with the last layer, DFlash
ids, and the EAGLE3 ids with the last layer's capture taken after the final norm,
``post_norm``: TP 1, and TP 2 where the layers defer). TP 4 runs the EAGLE3 default and
DFlash sets, unfused and FlashInfer-fused (``TP4_KINDS``). Each TP runs its cases in one
call through one warm pool; the TP = 1 reference runs in this worker.

Every rank equals the TP = 1 reference exactly and each other; K of K; no capture
shares storage with the final hidden states; the final hidden states are unchanged
by capturing. (Captures modified after they were taken show up as a mismatch with
the reference, which is taken with hooks, not by the capture code.)

Guards follow the survey: a case guards the patch that fixes the bug it exercises
(see ``guards_for``), so `make ablation` checks each fails without that patch.
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

TPS = (1, 2, 4)
# The post-norm capture is the final norm's output: every model at TP 1; at TP 2 the
# models whose layers defer their all-reduce into a fused norm, where the capture must
# be the complete normalised stream on every rank (the parity tier runs every family
# transformers implements at TP 2).
# TP 4 adds a third world size to the partial sums and the head split, not a capture
# path: it runs the set without the last layer (bug A's) and one with it and the first
# layer (DFlash's; bug C's), unfused and deferred into FlashInfer's fused norm. The
# other sets and aiter's in-place fusion run at TP 1 and 2 (and, with CUDA's aliasing,
# in the parity tier). This halves TP 4's share of `make test` (52 s of 2 cores).
TP4_KINDS = {("eagle3-default", "off"), ("eagle3-default", "flashinfer"),
             ("dflash", "off"), ("dflash", "flashinfer")}
# The patch that lets the draft choose the last layer's capture (docs/MODELS.md).
FINAL_LAYER_CAPTURE = "final-layer-capture"


def _cases():
    out = []
    for name, spec in sorted(specs().items()):
        if not spec.in_matrix:
            continue
        fusions = ["off", "flashinfer", "aiter"] if spec.defers else ["off"]
        sets = layer_sets(spec.tiny.num_layers)
        for set_name, layers in sets.items():
            for fusion in fusions:
                out.append((f"{name}-{set_name}-{fusion}",
                            dict(model=name, layers_to_capture=layers, fusion=fusion),
                            (set_name, fusion)))
        for fusion in fusions if spec.post_norm else []:
            out.append((f"{name}-post-norm-{fusion}",
                        dict(model=name, layers_to_capture=sets["eagle3-last"], fusion=fusion,
                             final_layer_capture="post_norm"),
                        ("post-norm", fusion)))
    return out


CASES = _cases()


def guards_for(tp: int, case: dict) -> list[str]:
    """The Patch-Ids (of the active base's series) whose bugs this case exercises."""
    spec = specs()[case["model"]]
    bugs = spec.bugs()
    with_last = spec.tiny.num_layers in case["layers_to_capture"]
    fused = tp > 1 and case["fusion"] != "off"
    wanted = []
    if "C" in bugs and with_last:
        wanted.append("C")
    if "A" in bugs and fused and not with_last:
        wanted.append("A")
    wanted += sorted(bugs & {"E", "X"})
    if "F" in bugs and fused:
        wanted.append("F")
    patches = {p for p in (spec.patch_for(b) for b in wanted) if p}
    if case.get("final_layer_capture") == "post_norm":
        # P: the model refused post_norm, and a patch of its own serves it (beam).
        patches.add(spec.patch_for("P") if "P" in bugs else FINAL_LAYER_CAPTURE)
    return sorted(patches)


def _at(tp: int) -> list[int]:
    """The indices in CASES of the cases that run at ``tp``."""
    if tp == 4:
        return [i for i, (_, _, kind) in enumerate(CASES) if kind in TP4_KINDS]
    return [i for i, (_, c, _) in enumerate(CASES)
            if c.get("final_layer_capture") != "post_norm" or tp == 1
            or (tp == 2 and specs()[c["model"]].defers)]


def _params():
    for tp in TPS:
        for idx in _at(tp):
            case_id, case, _ = CASES[idx]
            marks = [pytest.mark.multirank] + ([pytest.mark.world_size(tp)] if tp > 1 else [])
            marks += [pytest.mark.guards(g) for g in guards_for(tp, case)]
            yield pytest.param(tp, idx, id=f"tp{tp}-{case_id}", marks=marks)


_RESULTS: dict = {}


def _selected(session) -> dict[int, list[int]]:
    """{tp: the indices in CASES of this session's tests of the matrix} (after ``-k`` and
    ``--guards``). Only those cases run, at each TP and in the TP = 1 reference: an
    ablation run that guards one model does not pay for the whole matrix. Under xdist
    every worker collects every test, so this is the session's selection, not the
    worker's share."""
    out: dict[int, set[int]] = {}
    for item in session.items:
        spec = getattr(item, "callspec", None)
        if spec is not None and item.nodeid.split("::", 1)[0].endswith("test_model_matrix.py"):
            out.setdefault(spec.params["tp"], set()).add(spec.params["idx"])
    return {tp: sorted(idx) for tp, idx in out.items()}


@pytest.fixture(scope="module")
def tp1_reference(sglang_tp1, request):
    """{index in CASES: the TP = 1 result}, for every case selected at any TP."""
    from harness.suites.models import model_matrix

    wanted = sorted(set().union(*_selected(request.session).values()))
    return dict(zip(wanted, model_matrix(0, 1, [CASES[i][1] for i in wanted])))


def _results(rank_pool, session, tp):
    """Per rank: {index in CASES: result} for the selected cases of this TP."""
    if tp not in _RESULTS:
        at = _selected(session)[tp]
        per_rank = rank_pool(tp, timeout=900).run(
            "harness.suites.models:model_matrix", [CASES[i][1] for i in at]
        )
        _RESULTS[tp] = [dict(zip(at, results)) for results in per_rank]
    return _RESULTS[tp]


@pytest.mark.parametrize("tp, idx", list(_params()))
def test_model_captures_match_tp1_reference(request, rank_pool, tp1_reference, tp, idx):
    ref = tp1_reference[idx]
    assert "error" not in ref, ref.get("error")
    per_rank = [r[idx] for r in _results(rank_pool, request.session, tp)] if tp > 1 else [ref]
    for res in per_rank:
        assert "error" not in res, f"rank {res['rank']} raised:\n{res.get('error')}"
    for res in per_rank:
        r = res["rank"]
        assert res["num_captured"] == res["num_expected"], (
            f"rank {r}: captured {res['num_captured']} of {res['num_expected']} aux hidden states"
        )
        assert torch.equal(res["captures"], ref["expected"]), (
            f"rank {r}: captures differ from the TP=1 reference "
            f"(max abs diff {(res['captures'] - ref['expected']).abs().max().item()})"
        )
        assert torch.equal(res["final"], ref["reference_final"]), (
            f"rank {r}: final hidden states differ from the TP=1 reference "
            f"(max abs diff {(res['final'] - ref['reference_final']).abs().max().item()})"
        )
        assert res["shares_storage_with_final"] == [], (
            f"rank {r}: captures {res['shares_storage_with_final']} share storage with the "
            "final hidden states"
        )
    for res in per_rank[1:]:
        assert torch.equal(res["captures"], per_rank[0]["captures"]), (
            f"rank {res['rank']} and rank 0 captured different tensors"
        )
