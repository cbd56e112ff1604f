# upstream-path: test/registered/unit/models/test_lfm2_aux_packer.py
"""Lfm2Model and Lfm2MoeModel pack their DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Lfm2Model and Lfm2MoeModel (a
flagged decoder layer captures its input, attention and short-conv layers
alike; the last layer's output is taken after the loop) collect into
AuxHiddenStatePacker instead: each capture is copied once into its slot of one
[T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
get_aux_hidden_states_width on Lfm2ForCausalLM, Lfm2MoeForCausalLM and
Lfm2VlForConditionalGeneration.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the model's
forward are the real ones; their norms, attention / short-conv mixers and
feed-forward blocks are small stand-ins.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2Model
from sglang.srt.models.lfm2_moe import (
    Lfm2MoeDecoderLayer,
    Lfm2MoeForCausalLM,
    Lfm2MoeModel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
# (model, decoder layer, CausalLM, the forward's embeddings argument)
FAMILIES = (
    (Lfm2Model, Lfm2DecoderLayer, Lfm2ForCausalLM, "input_embeds"),
    (Lfm2MoeModel, Lfm2MoeDecoderLayer, Lfm2MoeForCausalLM, "inputs_embeds"),
)


class _Identity(nn.Module):
    def forward(self, hidden_states):
        return hidden_states


class _Mixer(nn.Module):
    """An attention or short-conv mixer whose output is ``value`` everywhere."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, *args):
        hidden_states = args[1] if len(args) == 3 else args[0]
        return torch.full_like(hidden_states, self.value)


class _NoFFN(nn.Module):
    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


class _Norm(nn.Module):
    """The final norm (no residual), out of place."""

    def forward(self, hidden_states):
        return hidden_states * 0.5


def _layer(layer_cls, layer_id):
    """The real decoder layer: attention and short-conv layers alternate; each
    adds ``layer_id + 1`` to the stream."""
    layer = layer_cls.__new__(layer_cls)
    nn.Module.__init__(layer)
    layer.is_attention_layer = layer_id % 2 == 1
    layer._is_layer_to_capture = False
    layer.operator_norm = _Identity()
    layer.ffn_norm = _Identity()
    mixer = _Mixer(float(layer_id + 1))
    if layer.is_attention_layer:
        layer.self_attn = mixer
    else:
        layer.conv = mixer
    layer.feed_forward = _NoFFN()
    return layer


def _model(family, layers_to_capture=()):
    model_cls, layer_cls, _, _ = family
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_layer(layer_cls, i) for i in range(NUM_LAYERS)])
    model.embedding_norm = _Norm()
    model.layers_to_capture = []
    # The model's own setter: the list, and the flags of the layers it names.
    model.set_dflash_layers_to_capture(list(layers_to_capture))
    return model


def _run(family, model, embeds, buffer=None, mode=ForwardMode.EXTEND):
    forward_batch = types.SimpleNamespace(
        forward_mode=mode, aux_hidden_states_buffer=buffer
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        **{family[3]: embeds},
    )


def _expected(embeds, layers_to_capture):
    # capture index i is the input of layer i: embeds + 1 + ... + i
    return torch.cat(
        [embeds + float(sum(range(1, i + 1))) for i in layers_to_capture], dim=-1
    )


class TestLfm2AuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last index is the last layer's output, taken after the loop.
        layers_to_capture = [1, 2, NUM_LAYERS]
        for family in FAMILIES:
            with self.subTest(model=family[0].__name__):
                embeds = torch.randn(TOKENS, HIDDEN)
                model = _model(family, layers_to_capture)
                hidden, aux = _run(family, model, embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(
                    tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN)
                )
                expected = _expected(embeds, layers_to_capture)
                torch.testing.assert_close(aux, expected)
                torch.testing.assert_close(hidden, expected[:, -HIDDEN:] * 0.5)
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_is_the_final_norm_output(self):
        from sglang.srt.layers.aux_hidden_states import set_final_layer_capture

        layers_to_capture = [2, NUM_LAYERS]
        set_final_layer_capture("post_norm")
        try:
            for family in FAMILIES:
                with self.subTest(model=family[0].__name__):
                    embeds = torch.randn(TOKENS, HIDDEN)
                    model = _model(family, layers_to_capture)
                    hidden, aux = _run(family, model, embeds.clone())
                    self.assertIsInstance(aux, torch.Tensor)
                    expected = _expected(embeds, layers_to_capture)
                    torch.testing.assert_close(aux[:, :HIDDEN], expected[:, :HIDDEN])
                    torch.testing.assert_close(aux[:, HIDDEN:], hidden)
                    self.assertNotEqual(
                        aux.untyped_storage().data_ptr(),
                        hidden.untyped_storage().data_ptr(),
                    )
        finally:
            set_final_layer_capture("pre_norm")

    def test_decode_graph_buffer_is_filled_in_place(self):
        layers_to_capture = [1, NUM_LAYERS]
        for family in FAMILIES:
            with self.subTest(model=family[0].__name__):
                embeds = torch.randn(TOKENS, HIDDEN)
                shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
                model = _model(family, layers_to_capture)
                _, aux = _run(family, model, embeds.clone(), shared[:TOKENS])
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                torch.testing.assert_close(
                    shared[:TOKENS], _expected(embeds, layers_to_capture)
                )
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        for family in FAMILIES:
            with self.subTest(model=family[0].__name__):
                out = _run(family, _model(family), torch.randn(TOKENS, HIDDEN))
                self.assertIsInstance(out, torch.Tensor)

    def test_idle_batch_returns_hidden_states_alone(self):
        # The layers skip an idle batch and take no capture; the CausalLM then
        # passes no aux hidden states on (DFlash skips idle batches).
        for family in FAMILIES:
            with self.subTest(model=family[0].__name__):
                model = _model(family, [1, NUM_LAYERS])
                out = _run(family, model, torch.randn(0, HIDDEN), mode=ForwardMode.IDLE)
                self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        from sglang.srt.models.lfm2_vl import Lfm2VlForConditionalGeneration

        for family in FAMILIES:
            with self.subTest(model=family[2].__name__):
                lm_cls = family[2]
                lm = lm_cls.__new__(lm_cls)
                nn.Module.__init__(lm)
                lm.model = _model(family)
                lm.config = types.SimpleNamespace(
                    hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
                )
                lm.pp_group = types.SimpleNamespace(is_last_rank=True)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)
                if lm_cls is Lfm2ForCausalLM:
                    # LFM2-VL's language model is an Lfm2ForCausalLM.
                    vl = Lfm2VlForConditionalGeneration.__new__(
                        Lfm2VlForConditionalGeneration
                    )
                    nn.Module.__init__(vl)
                    vl.language_model = lm
                    self.assertEqual(vl.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
