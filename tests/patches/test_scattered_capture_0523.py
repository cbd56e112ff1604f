"""SGLang 0.5.23: captures cover every token when the attention-TP input is scattered
(``--enable-attn-tp-input-scattered``), as patch capture-gather-scattered makes them on
the pin (tests/multirank/test_scattered_capture.py).

0.5.23 rewrote the communicator (``layers/layer_boundary``): ``DeepseekV2DecoderLayer``
captures through ``attn_boundary.prepare(capture_gathered=aux)``, which takes
``stream.residual`` through ``entry.input_move``. Whether that covers every token on an
input-scattered batch is decided here by a run, not by reading: the real
``DeepseekV2Model.forward`` (MLA stand-in, q-lora config) built and run under
:func:`harness.standins.v0_5_23.scattered.attn_tp_input_scattered` (scattering bound
at construction, SGLang's own ``init_context`` with DFlash as the speculative
algorithm; EAGLE3 is excluded upstream), on an uneven extend batch (7 tokens, which the
model runner pads to a multiple of TP: 8), at TP = 2 and 4 over gloo. Every rank's
packed captures must be the full padded token set, ``[8, K * hidden]``, equal to the
TP = 1 reference (where nothing scatters) exactly; its first 7 rows equal to the
reference of the unpadded batch.

Layer sets as ``set_dflash_layers_to_capture`` makes them (``id + 1``): with the last
layer (index ``end_layer``, captured at the final norm by dsv2-capture-final-layer)
and without it.

Each case guards the patches it needs: capture-gather-scattered (pristine 0.5.23
captures each rank's 1/tp share of the tokens) and, for a set with the last layer,
dsv2-capture-final-layer.
"""

from __future__ import annotations

import pytest
import torch

BASE = "0.5.23"
GATHER = "capture-gather-scattered"
FINAL = "dsv2-capture-final-layer"
NUM_LAYERS = 8  # the deepseek_v2 spec's tiny config
TOKENS = 7  # uneven: the model runner pads an input-scattered batch to a multiple of TP
PADDED = 8  # ceil(7 / tp) * tp for tp = 2 and 4
FN = "harness.standins.v0_5_23.scattered:scattered_capture_matrix"

# set_dflash_layers_to_capture(ids) -> [id + 1 for id in ids]
LAYER_SETS = {
    "dflash-no-last": [0 + 1, 2 + 1, 5 + 1],  # [1, 3, 6]
    "dflash-1-4-7": [1 + 1, 4 + 1, 7 + 1],  # [2, 5, 8]: with the last layer
    "dflash": [0 + 1, 2 + 1, 6 + 1, 7 + 1],  # [1, 3, 7, 8]: with the last layer
}
CASES = [dict(num_tokens=TOKENS, layers_to_capture=layers) for layers in LAYER_SETS.values()]
IDS = list(LAYER_SETS)

pytestmark = pytest.mark.bases(BASE)


def _needs(layers) -> list:
    return [GATHER] + ([FINAL] if NUM_LAYERS in layers else [])


_RESULTS: dict = {}


@pytest.fixture(scope="module")
def tp1_reference(sglang_tp1):
    from harness.standins.v0_5_23.scattered import scattered_capture_matrix

    refs = scattered_capture_matrix(0, 1, [dict(c, reference=True) for c in CASES])
    padded = scattered_capture_matrix(
        0, 1, [dict(c, reference=True, pad_to=PADDED) for c in CASES]
    )
    for ref in refs + padded:
        assert "error" not in ref, ref.get("error")
    return refs, padded


def _results(rank_pool, tp):
    if tp not in _RESULTS:
        _RESULTS[tp] = rank_pool(tp, timeout=900).run(FN, CASES)
    return _RESULTS[tp]


def _max_diff(a, b) -> str:
    if a.shape != b.shape:
        return "n/a (shapes differ)"
    return f"{(a - b).abs().max().item():.3g}"


def _params():
    for tp in (2, 4):
        for idx, case_id in enumerate(IDS):
            marks = [pytest.mark.multirank, pytest.mark.world_size(tp)]
            marks += [pytest.mark.guards(p) for p in _needs(CASES[idx]["layers_to_capture"])]
            yield pytest.param(tp, idx, id=f"tp{tp}-{case_id}", marks=marks)


@pytest.mark.parametrize("tp, idx", list(_params()))
def test_input_scattered_captures_match_tp1_reference(rank_pool, tp1_reference, tp, idx):
    refs, padded = tp1_reference
    ref, ref_padded = refs[idx], padded[idx]
    assert ref_padded["expected"].shape == (PADDED, ref["expected"].shape[1])
    for per_rank in _results(rank_pool, tp):
        res = per_rank[idx]
        r = res["rank"]
        assert "error" not in res, f"rank {r} raised:\n{res.get('error')}"
        # the scattered path really ran (not a vacuous pass)
        assert res["allow_input_scattered"] and res["ran_scattered"], (
            f"rank {r}: attention input was not scattered"
        )
        assert res["padded_tokens"] == PADDED
        caps = res["captures"]
        assert res["num_captured"] == res["num_expected"], (
            f"rank {r}: captured {res['num_captured']} of {res['num_expected']}"
        )
        assert caps.shape == ref_padded["expected"].shape, (
            f"rank {r}: captures {tuple(caps.shape)}, expected "
            f"{tuple(ref_padded['expected'].shape)} (every token of the padded batch; "
            f"{PADDED // tp} rows is this rank's scattered share)"
        )
        assert torch.equal(caps, ref_padded["expected"]), (
            f"rank {r}: captures differ from the TP=1 reference (max abs diff "
            f"{_max_diff(caps, ref_padded['expected'])})"
        )
        assert torch.equal(caps[:TOKENS], ref["expected"]), (
            f"rank {r}: the real tokens' captures differ from the TP=1 reference of the "
            f"unpadded batch (max abs diff {_max_diff(caps[:TOKENS], ref['expected'])})"
        )
        assert torch.equal(res["final"], ref_padded["reference_final"]), (
            f"rank {r}: final hidden states differ from the TP=1 reference"
        )


@pytest.mark.multirank
@pytest.mark.parametrize(
    "tp", [pytest.param(tp, marks=pytest.mark.world_size(tp)) for tp in (2, 4)]
)
def test_final_norm_residual_is_full_token(rank_pool, tp):
    """The residual reaching ``residual_batch.final_norm`` on an input-scattered batch
    covers every token on every rank (the terminal FFN returns the attention's rows), so
    a final-layer capture there (``final_norm(capture=...)``) needs no gather."""
    idx = IDS.index("dflash-no-last")  # runs on every tree: nothing captured at the norm
    for per_rank in _results(rank_pool, tp):
        res = per_rank[idx]
        assert "error" not in res, f"rank {res['rank']} raised:\n{res.get('error')}"
        assert res["ran_scattered"]
        assert res["final_norm_residual_rows"] == PADDED, (
            f"rank {res['rank']}: residual at final_norm has {res['final_norm_residual_rows']} "
            f"rows, the batch {PADDED}"
        )
        assert res["final_norm_output_rows"] == PADDED


@pytest.mark.multirank
@pytest.mark.world_size(2)
def test_scattering_gate_is_sglangs(rank_pool):
    """The switch leaves SGLang's own conditions in force: DFlash scatters, EAGLE3 does
    not (``get_spec().speculative_algorithm != "EAGLE3"``), nor a model without q-lora."""
    fn = "harness.standins.v0_5_23.scattered:scatter_allowed"
    pool = rank_pool(2, timeout=900)
    assert pool.run(fn, "DFLASH") == [True, True]
    assert pool.run(fn, "EAGLE3") == [False, False]
    assert pool.run(fn, "DFLASH", None) == [False, False]


def _gather_ownership(axes):
    """The ``owned`` the capture move's attention-TP gather is called with, for a
    residual sharded over ``axes`` returned to the producer's unsharded rows: the real
    ``boundary._capture_move`` and ``ops.move_rows``, the two collectives recorded
    (their own buffers need a process group; what is checked is the request)."""
    import types

    from sglang.srt.layers.layer_boundary import boundary, ops
    from sglang.srt.layers.layer_boundary.layout import Layout, TokenAxis

    calls = []

    def attn_tp_gather(tensor, *, owned=False):
        calls.append(("attn_tp_gather", owned))
        return torch.cat([tensor, tensor])

    def dp_gather(tensor, forward_batch, cp_shard_counts=None):
        calls.append(("dp_gather", None))
        return tensor.clone()

    saved = ops.attn_tp_gather, ops.dp_gather
    ops.attn_tp_gather, ops.dp_gather = attn_tp_gather, dp_gather
    try:
        edge = types.SimpleNamespace(
            residual_to=Layout(sharded=frozenset(TokenAxis[a] for a in axes)),
            produced=types.SimpleNamespace(layout=Layout(sharded=frozenset())))
        move, _ = boundary._capture_move(edge)
        out = move(torch.ones(3, 4), forward_batch=None)
    finally:
        ops.attn_tp_gather, ops.dp_gather = saved
    assert out.shape == (6, 4)
    return calls


@pytest.mark.guards(GATHER)
def test_pure_tp_capture_gather_takes_a_buffer_of_its_own(sglang_tp1):
    """Pure attention TP, scattered input: the gather is the move's last step and the
    capture outlives the local DP buffer, which no MLP sync sized: a buffer of its own."""
    assert _gather_ownership(["ATTN_TP"]) == [("attn_tp_gather", True)]


def test_dp_attention_capture_gather_stays_in_the_local_dp_buffer(sglang_tp1):
    """Attention TP inside attention DP: the DP gather copies the TP gather's rows out
    of the local DP buffer at once, into the global one; a buffer of its own there would
    be a [T, H] allocation per capture that the packer then copies again (issue 41).
    Pristine 0.5.23 gathers there as well, so no guards mark: this keeps it so."""
    assert _gather_ownership(["ATTN_TP", "ATTN_DP"]) == [("attn_tp_gather", False),
                                                         ("dp_gather", None)]
