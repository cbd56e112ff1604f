# upstream-path: test/registered/unit/models/test_muse_glimmer_aux_packer.py
"""MuseGlimmerModel packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). MuseGlimmerModel (capture
index i is the input of layer i; index num_layers, the last layer's output, is
taken after the loop, before the final norm or, under ``post_norm``, its
output) collects into AuxHiddenStatePacker instead: each capture is copied
once into its slot of one [T, K * H] buffer, which is what the forward returns
and what pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph
passes a slice of one shared buffer on the batch (aux_hidden_states_buffer),
sized by MuseGlimmerForCausalLM.get_aux_hidden_states_width (which the
multimodal MuseGlimmerForConditionalGeneration inherits).

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins that return the whole stream, as MuseGlimmerDecoderLayer does, and
the final norm updates its input in place; MuseGlimmerModel.forward is the
real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import (
    pack_aux_hidden_states,
    set_final_layer_capture,
)
from sglang.srt.models.muse_glimmer import (
    MuseGlimmerForCausalLM,
    MuseGlimmerForConditionalGeneration,
    MuseGlimmerModel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


class _Layer(nn.Module):
    """MuseGlimmerDecoderLayer's interface: takes the stream and returns the
    next one (its residual adds are inside); adds ``layer_id + 1``."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch):
        return hidden_states + float(self.layer_id + 1)


class _InPlaceNorm(nn.Module):
    """A final norm that overwrites its input, as a fused kernel may."""

    def forward(self, hidden_states):
        return hidden_states.mul_(0.5)


def _model(layers_to_capture=()):
    model = MuseGlimmerModel.__new__(MuseGlimmerModel)
    nn.Module.__init__(model)
    model.embed_norm = None
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.norm = _InPlaceNorm()
    model.layers_to_capture = list(layers_to_capture)
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(aux_hidden_states_buffer=buffer)
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _input_of(embeds, i):
    # The input of layer i (index num_layers: the last layer's output).
    return embeds + float(sum(range(1, i + 1)))


def _expected(embeds, layers_to_capture):
    return torch.cat([_input_of(embeds, i) for i in layers_to_capture], dim=-1)


def _causal_lm(cls=MuseGlimmerForCausalLM):
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = _model()
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm.capture_aux_hidden_states = False
    return lm


class TestMuseGlimmerAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # Index 0 is the embedding; index num_layers is the last layer's output
        # (pre_norm: the stream entering the final norm, kept apart from the
        # norm's in-place update).
        layers_to_capture = [0, 2, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN))
        torch.testing.assert_close(aux, _expected(embeds, layers_to_capture))
        torch.testing.assert_close(hidden, _input_of(embeds, NUM_LAYERS) * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_fills_the_last_slot(self):
        layers_to_capture = [1, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        set_final_layer_capture("post_norm")
        try:
            hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        finally:
            set_final_layer_capture("pre_norm")
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, 2 * HIDDEN))
        first, last = aux.split(HIDDEN, dim=-1)
        torch.testing.assert_close(first, _input_of(embeds, 1))
        torch.testing.assert_close(last, _input_of(embeds, NUM_LAYERS) * 0.5)
        torch.testing.assert_close(last, hidden)
        self.assertNotEqual(
            aux.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()
        )

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
        for cls in (MuseGlimmerForCausalLM, MuseGlimmerForConditionalGeneration):
            with self.subTest(cls=cls.__name__):
                lm = _causal_lm(cls)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                # Id num_layers is the last layer's output, taken after the loop.
                lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS])
                self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
