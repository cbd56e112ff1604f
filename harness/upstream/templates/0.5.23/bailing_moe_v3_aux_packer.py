# upstream-path: test/registered/unit/models/test_bailing_moe_v3_aux_packer.py
"""BailingMoELinearModel packs its DSpark aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). BailingMoELinearModel (capture
ids are layer outputs: layer i's boundary captures the output of layer i - 1,
the final norm the last layer's, or its own output under ``post_norm``)
collects into AuxHiddenStatePacker instead: each capture is copied once into
its slot of one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. Only the last pipeline stage
captures. A DFlash-family decode CUDA graph passes a slice of one shared buffer
on the batch (aux_hidden_states_buffer), sized by
BailingMoeV3ForCausalLM.get_aux_hidden_states_width. A batch without rows (an
idle one among them) takes no captures and returns the hidden states alone.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); BailingMoELinearModel.forward is the real
one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import (
    pack_aux_hidden_states,
    set_final_layer_capture,
)
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardMode,
    PPProxyTensors,
)
from sglang.srt.models.bailing_moe_v3 import (
    BailingMoELinearModel,
    BailingMoeV3ForCausalLM,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


class _FromPP:
    """A pipeline stage's entry: a fresh stream holding the received output."""

    def from_pp(self, pp_proxy_tensors, forward_batch):
        residual_batch.start(forward_batch)
        return pp_proxy_tensors["hidden_states"]


class _Layer(nn.Module):
    """Completes the previous layer's output at its boundary, captures it when
    asked (``capture_output``, as the attention boundary takes it), and adds
    ``layer_id + 1``, left to the next boundary (or the final norm)."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.attn_boundary = _FromPP()

    def forward(
        self,
        hidden_states,
        positions,
        forward_batch,
        zero_allocator,
        capture_output=None,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        return residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None, **unused_kwargs):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(start_layer=0, end_layer=NUM_LAYERS):
    model = BailingMoELinearModel.__new__(BailingMoELinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = start_layer, end_layer
    model.layers_to_capture = None
    model.capture_aux_hidden_states = False
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(
        is_first_rank=start_layer == 0, is_last_rank=end_layer == NUM_LAYERS
    )
    return model


def _causal_lm(**stage):
    lm = BailingMoeV3ForCausalLM.__new__(BailingMoeV3ForCausalLM)
    nn.Module.__init__(lm)
    lm.model = _model(**stage)
    lm.pp_group = lm.model.pp_group
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm.capture_aux_hidden_states = False
    return lm


def _capturing(layer_ids, **stage):
    # The model as BailingMoeV3ForCausalLM.set_dspark_layers_to_capture leaves it.
    lm = _causal_lm(**stage)
    lm.set_dspark_layers_to_capture(list(layer_ids))
    return lm.model


def _run(model, embeds, buffer=None, pp_proxy_tensors=None, mode=ForwardMode.EXTEND):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=mode,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
        pp_proxy_tensors=pp_proxy_tensors,
    )


def _after(embeds, layer_id):
    # The output of layer ``layer_id``: embeds + 1 + ... + (layer_id + 1).
    return embeds + float(sum(range(1, layer_id + 2)))


def _expected(embeds, layer_ids):
    return torch.cat([_after(embeds, i) for i in layer_ids], dim=-1)


class TestBailingMoeV3AuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's output (pre_norm: the stream entering
        # the final norm, kept apart from the norm's in-place update).
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_capturing(layer_ids), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        torch.testing.assert_close(aux, _expected(embeds, layer_ids))
        torch.testing.assert_close(hidden, _after(embeds, NUM_LAYERS - 1) * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_fills_the_last_slot(self):
        layer_ids = [1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        set_final_layer_capture("post_norm")
        try:
            hidden, aux = _run(_capturing(layer_ids), embeds.clone())
        finally:
            set_final_layer_capture("pre_norm")
        self.assertEqual(tuple(aux.shape), (TOKENS, 2 * HIDDEN))
        first, last = aux.split(HIDDEN, dim=-1)
        torch.testing.assert_close(first, _after(embeds, 1))
        torch.testing.assert_close(last, _after(embeds, NUM_LAYERS - 1) * 0.5)
        torch.testing.assert_close(last, hidden)
        self.assertNotEqual(
            aux.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()
        )

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = [0, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
        _, aux = _run(_capturing(layer_ids), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(shared[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_last_pipeline_stage_packs_the_ids_of_its_layers(self):
        # Only the last stage captures: the ids of its layers (2 and 3), not
        # those of the earlier stage's.
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        received = PPProxyTensors({"hidden_states": _after(embeds, 1)})
        model = _capturing(layer_ids, start_layer=2)
        _, aux = _run(model, torch.empty(0, HIDDEN), pp_proxy_tensors=received)
        self.assertIsInstance(aux, torch.Tensor)
        torch.testing.assert_close(aux, _expected(embeds, [2, NUM_LAYERS - 1]))

    def test_batch_without_rows_returns_hidden_states_alone(self):
        layer_ids = [0, 2, NUM_LAYERS - 1]
        for mode in (ForwardMode.EXTEND, ForwardMode.IDLE):
            out = _run(_capturing(layer_ids), torch.empty(0, HIDDEN), mode=mode)
            self.assertIsInstance(out, torch.Tensor)
            self.assertEqual(tuple(out.shape), (0, HIDDEN))

    def test_idle_batch_takes_no_captures(self):
        # An idle batch skips the final norm, so it could not take the last
        # layer's capture: it takes none rather than K - 1 of K.
        layer_ids = [0, NUM_LAYERS - 1]
        out = _run(
            _capturing(layer_ids), torch.randn(TOKENS, HIDDEN), mode=ForwardMode.IDLE
        )
        self.assertIsInstance(out, torch.Tensor)

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        layer_ids = [0, 2, NUM_LAYERS - 1]
        lm = _causal_lm()
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dspark_layers_to_capture(layer_ids)
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)
        # Under PP only the last stage captures, the ids of its own layers.
        first = _causal_lm(end_layer=2)
        first.set_dspark_layers_to_capture(layer_ids)
        self.assertEqual(first.get_aux_hidden_states_width(), 0)
        last = _causal_lm(start_layer=2)
        last.set_dspark_layers_to_capture(layer_ids)
        self.assertEqual(last.get_aux_hidden_states_width(), 2 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
