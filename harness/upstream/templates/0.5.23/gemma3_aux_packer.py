# upstream-path: test/registered/unit/models/test_gemma3_aux_packer.py
"""Gemma3TextModel packs its EAGLE3/DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Gemma3TextModel collects into
AuxHiddenStatePacker instead: each capture (a layer's output,
``hidden_states + residual``) is copied once into its slot of one [T, K * H]
buffer, which is what the forward returns and what pack_aux_hidden_states
hands on unchanged. A DFlash decode CUDA graph passes a slice of one shared
buffer on the batch (aux_hidden_states_buffer), sized by
Gemma3ForCausalLM.get_aux_hidden_states_width (and the multimodal
Gemma3ForConditionalGeneration, which runs Gemma3ForCausalLM).

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins with Gemma3DecoderLayer's residual layout, and the norms update
their inputs in place like the fused GPU kernel; Gemma3TextModel.forward is
the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM, Gemma3TextModel
from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


class _InPlaceNorm(nn.Module):
    """gemma_fused_add_rmsnorm: the output overwrites x, x + residual the
    residual, as in Gemma3RMSNorm.forward_cuda."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * 0.5
        residual.add_(x)
        x.copy_(residual * 0.5)
        return x, residual


class _Layer(nn.Module):
    """Gemma3DecoderLayer's residual layout: it adopts its input as the
    residual in the first layer, otherwise adds its input in place with the
    fused input norm, and returns its FFN output and the residual apart.
    Its FFN output is the constant ``layer_id + 1``."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = _InPlaceNorm()

    def forward(self, positions, hidden_states, forward_batch, residual=None, **kw):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return torch.full_like(hidden_states, float(self.layer_id + 1)), residual


def _model(layers_to_capture=()):
    model = Gemma3TextModel.__new__(Gemma3TextModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.rotary_emb = model.rotary_emb_local = lambda hidden_states, positions: None
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(aux_hidden_states_buffer=buffer)
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _expected(embeds, layers_to_capture):
    # Capture index i is the output of layer i - 1 (index 0 the embedding):
    # layer k's FFN output is k + 1, so its output is embeds + 1 + ... + (k + 1).
    return torch.cat(
        [embeds + float(sum(range(1, i + 1))) for i in layers_to_capture], dim=-1
    )


def _causal_lm():
    lm = Gemma3ForCausalLM.__new__(Gemma3ForCausalLM)
    nn.Module.__init__(lm)
    lm.model = _model()
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
    lm.capture_aux_hidden_states = False
    return lm


class TestGemma3AuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # Index 0 is the embedding; the last index is the last layer's output,
        # taken after the loop.
        layers_to_capture = [0, 1, 3, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN))
        expected = _expected(embeds, layers_to_capture)
        torch.testing.assert_close(aux, expected)
        torch.testing.assert_close(hidden, expected[:, -HIDDEN:] * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layers_to_capture = [1, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
        _, aux = _run(_model(layers_to_capture), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(
            shared[:TOKENS], _expected(embeds, layers_to_capture)
        )
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        lm = _causal_lm()
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_multimodal_wrapper_reports_its_language_model_width(self):
        mm = Gemma3ForConditionalGeneration.__new__(Gemma3ForConditionalGeneration)
        nn.Module.__init__(mm)
        mm.language_model = _causal_lm()
        self.assertEqual(mm.get_aux_hidden_states_width(), 0)
        mm.set_eagle3_layers_to_capture([0, NUM_LAYERS - 1])
        self.assertEqual(mm.get_aux_hidden_states_width(), 2 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
