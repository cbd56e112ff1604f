# upstream-path: test/registered/unit/models/test_minimax_m3_aux_packer.py
"""MiniMaxM3Model packs its EAGLE3/DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). MiniMaxM3Model (its layers
capture their input through the attention boundary's ``capture_gathered`` when
the setters flag them, the last layer's output at the final norm) collects
into AuxHiddenStatePacker instead: each capture is copied once into its slot
of one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
get_aux_hidden_states_width of MiniMaxM3SparseForCausalLM or, for the
multimodal checkpoint, MiniMaxM3SparseForConditionalGeneration.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); MiniMaxM3Model.forward and the setters
are the real ones.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.minimax_m3 import MiniMaxM3Model, MiniMaxM3SparseForCausalLM
from sglang.srt.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


class _Layer(nn.Module):
    """Completes the previous layer's output at its boundary, captures it into
    ``captured_last_layer_outputs`` when the model passes the collector (as
    ``attn_boundary.prepare(capture_gathered=...)`` does), and adds
    ``layer_id + 1`` for the next boundary."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self, positions, hidden_states, forward_batch, captured_last_layer_outputs=None
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        return residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)


class _PlainNorm(nn.Module):
    """The final norm: adds the residual when one is passed (as the fused
    add-norm kernel does) and halves the sum; returns the sum as the residual."""

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states * 0.5
        residual = hidden_states + residual
        return residual * 0.5, residual


def _model():
    model = MiniMaxM3Model.__new__(MiniMaxM3Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = []
    model.norm = _PlainNorm()
    model.finalize_norm = None
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _causal_lm(model):
    lm = MiniMaxM3SparseForCausalLM.__new__(MiniMaxM3SparseForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


def _capturing_model(layer_ids):
    """The model as MiniMaxM3SparseForCausalLM's EAGLE3 setter leaves it: capture
    index id + 1 listed, and the layers below end_layer flagged."""
    model = _model()
    _causal_lm(model).set_eagle3_layers_to_capture(list(layer_ids))
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _expected(embeds, layer_ids):
    # layer id k's output (capture index k + 1): embeds + 1 + ... + (k + 1)
    return torch.cat([embeds + float(sum(range(1, k + 2))) for k in layer_ids], dim=-1)


class TestMiniMaxM3AuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's output, taken at the final norm.
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_capturing_model(layer_ids), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        expected = _expected(embeds, layer_ids)
        torch.testing.assert_close(aux, expected)
        torch.testing.assert_close(hidden, expected[:, -HIDDEN:] * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = [1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
        _, aux = _run(_capturing_model(layer_ids), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(shared[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        lm = _causal_lm(_model())
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_eagle3_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_multimodal_wrapper_reports_the_packed_width(self):
        cls = MiniMaxM3SparseForConditionalGeneration
        vl = cls.__new__(cls)
        nn.Module.__init__(vl)
        vl.model = _model()
        vl.config = types.SimpleNamespace(
            text_config=types.SimpleNamespace(
                hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
            )
        )
        vl.pp_group = types.SimpleNamespace(is_last_rank=True)
        vl.capture_aux_hidden_states = False
        self.assertEqual(vl.get_aux_hidden_states_width(), 0)
        vl.set_dflash_layers_to_capture([1, NUM_LAYERS - 1])
        self.assertEqual(vl.get_aux_hidden_states_width(), 2 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
