"""What every 0.5.23 packer migration shares (patch aux-packer-infra; issue 28).

K, the captures a pipeline stage packs, is counted once (``count_aux_captures``, the
models' ``num_aux_captures`` through ``AuxCaptureCountMixin``), as the layer loops take
them: each distinct id in ``[start_layer, end_layer]`` once. Written per model it was a
sum over the ids, which counted a repeated id twice while the loop captured the layer
once (the packer then failed "captured K-1 of K"). The CausalLM's packed width (what a
DFlash decode graph sizes its shared buffer by) is one mixin; ``slot(like, dtype=)``
hands out a slot of another dtype than the value it is shaped like (muse_spark's fp32
stream cast into its operator-dtype slot). Checked on SGLang's own classes: the helpers,
Llama's model and CausalLM through them, and a real forward whose K comes from them.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("aux-packer-infra")

HIDDEN = 8


@pytest.fixture(scope="module")
def infra():
    from sglang.srt.layers import aux_hidden_states
    from sglang.srt.layers.aux_hidden_states import count_aux_captures  # noqa: F401

    return aux_hidden_states


def _llama(start, end, ids, capture=True):
    from sglang.srt.models.llama import LlamaForCausalLM, LlamaModel

    model = LlamaModel.__new__(LlamaModel)
    nn.Module.__init__(model)
    model.start_layer, model.end_layer = start, end
    if ids is not None:
        model.layers_to_capture = list(ids)
    lm = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.capture_aux_hidden_states = capture
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    return lm


@GUARD
@pytest.mark.parametrize("ids, start, end, k", [
    (None, 0, 4, 0),
    ([1, 2, 4], 0, 4, 3),   # 4: the last layer's output, after the loop
    ([2, 2, 3], 0, 4, 2),   # the loop takes layer 2's input once
    ([0, 3, 6], 0, 4, 2),   # 6 names no layer of this stage
    ([1, 3, 6], 2, 6, 2),   # the second of two stages: 1 is the first's
    ([1, 3, 6], 0, 2, 1),   # the first stage: 2 (its output) is not asked for
], ids=["none", "last", "repeat", "past-end", "second-stage", "first-stage"])
def test_k_is_the_distinct_ids_of_the_stage(infra, ids, start, end, k):
    assert infra.count_aux_captures(ids, start, end) == k
    assert _llama(start, end, ids).model.num_aux_captures() == k


@GUARD
def test_width_is_k_hidden_while_capturing(infra):
    assert _llama(0, 4, [1, 2, 4]).get_aux_hidden_states_width() == 3 * HIDDEN
    assert _llama(0, 4, [1, 2, 4], capture=False).get_aux_hidden_states_width() == 0
    assert _llama(0, 4, None).get_aux_hidden_states_width() == 0
    lm = _llama(0, 4, [1])
    lm.model = nn.Identity()  # a subclass whose model does not pack
    assert lm.get_aux_hidden_states_width() == 0


@GUARD
def test_slot_of_another_dtype_packs_like_cat_of_casts(infra):
    caps = [torch.randn(5, HIDDEN) for _ in range(3)]
    packer = infra.AuxHiddenStatePacker(3)
    for cap in caps:
        packer.slot(cap, dtype=torch.bfloat16).copy_(cap)
    packed = packer.finalize()
    assert packed.dtype == torch.bfloat16
    assert torch.equal(packed, torch.cat([c.to(torch.bfloat16) for c in caps], dim=-1))
    out = torch.empty(5, 2 * HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="captures need"):
        infra.AuxHiddenStatePacker(2, out=out).slot(caps[0], dtype=torch.float32)


@GUARD
def test_slot_with_dtype_traces_fullgraph(infra):
    caps = [torch.randn(5, HIDDEN) for _ in range(2)]

    def pack(a, b):
        packer = infra.AuxHiddenStatePacker(2)
        for x in (a, b):
            packer.slot(x, dtype=torch.bfloat16).copy_(x * 2)
        return packer.finalize()

    # Dynamo is on only for this compile (the suites' rank processes run with it off).
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(pack, backend="eager", fullgraph=True)
        got = compiled(*caps)
        torch._dynamo.reset()
    assert torch.equal(got, torch.cat([(c * 2).to(torch.bfloat16) for c in caps], -1))
