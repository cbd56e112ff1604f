# upstream-path: test/registered/unit/models/test_inkling_aux_packer.py
"""InklingCausalLLM packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). InklingCausalLLM (the language
model of InklingForConditionalGeneration) writes each tap, a tapped layer's
output taken before that layer's deferred short convolution, straight into its
slot of one AuxHiddenStatePacker buffer [T, K * H], which is what the forward
returns and what pack_aux_hidden_states hands on unchanged. A DFlash decode
CUDA graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by
InklingForConditionalGeneration.get_aux_hidden_states_width.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``) whose contribution carries a deferred
ShortConvUpdate, as Inkling's layers do; InklingCausalLLM.forward, its final
read and InklingForConditionalGeneration's setter and width are the real ones.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.layout import SumGroup
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.short_conv import ShortConvUpdate
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.inkling import (
    InklingCausalLLM,
    InklingForConditionalGeneration,
    _inkling_read,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


def _convolve(hidden_states, positions, forward_batch):
    # A channelwise stand-in for the layer's short convolution.
    return hidden_states * 2.0


class _Layer(nn.Module):
    """Applies the previous layer's deferred convolution at its entry (conv of
    the contribution plus the residual, written as the stream), then leaves
    ``layer_id + 1`` as its contribution with its own convolution deferred to
    the next boundary, as InklingDecoderLayer's MLP short convolution is."""

    def __init__(self, layer_id, scattered_sconv=False):
        super().__init__()
        self.layer_id = layer_id
        self.scattered_sconv = scattered_sconv
        # A one-rank group: all_gather_hidden hands the shard back as it is.
        self.attn_tp_group = types.SimpleNamespace(world_size=1)
        self.mlp_sconv = None
        self.mlp_ar_fusable = False

    def forward(self, hidden_states, positions, forward_batch, *, log_scaling_tau=None):
        if forward_batch.forward_mode.is_idle():
            return hidden_states
        stream = residual_batch.stream_of(forward_batch)
        value, residual = stream.input(hidden_states)
        if stream.pending is not None:
            value = stream.pending.update.update(stream.pending.complete(), residual)
        value = stream.write(value)
        update = ShortConvUpdate(_convolve, None, SumGroup.TP).bind(forward_batch)
        contribution = torch.full_like(value, float(self.layer_id + 1))
        return stream.record(contribution, update)


class _Norm(nn.Module):
    """The final add + norm: (x + residual) / 2, and the sum as residual."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * 0.5
        x = x + residual
        return x * 0.5, x


def _model(dflash_layer_ids=()):
    model = InklingCausalLLM.__new__(InklingCausalLLM)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(log_scaling_n_floor=None)
    model.layers = nn.ModuleList(
        [_Layer(i, scattered_sconv=(i == 2)) for i in range(NUM_LAYERS)]
    )
    model.norm = _Norm()
    model._final_read = _inkling_read()
    model._dflash_layers_to_capture = set()
    if dflash_layer_ids:
        model.set_dflash_layers_to_capture(list(dflash_layer_ids))
    return model


def _run(model, embeds, buffer=None, mode=ForwardMode.EXTEND):
    forward_batch = types.SimpleNamespace(
        forward_mode=mode,
        residual_stream=None,
        aux_hidden_states_buffer=buffer,
        input_ids=torch.zeros(embeds.shape[0], dtype=torch.long),
        positions=torch.arange(embeds.shape[0]),
    )
    return model.forward(
        input_ids=None,
        positions=forward_batch.positions,
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _expected(embeds, dflash_layer_ids):
    # Layer j's input stream is embeds + j * (j + 1) (each layer i adds its
    # convolved contribution 2 * (i + 1)); its tap, before the deferred
    # convolution, is that plus j + 1: embeds + (j + 1) ** 2.
    return torch.cat([embeds + float((j + 1) ** 2) for j in dflash_layer_ids], dim=-1)


class TestInklingAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's tap, taken inside the loop.
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layer_ids), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        torch.testing.assert_close(aux, _expected(embeds, layer_ids))
        # The final read applies the last deferred convolution, then the norm.
        torch.testing.assert_close(
            hidden, (embeds + float(NUM_LAYERS * (NUM_LAYERS + 1))) * 0.5
        )
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = [1, NUM_LAYERS - 1]
        lm = _causal_lm(_model())
        lm.set_dflash_layers_to_capture(layer_ids)
        # The decode graph runner sizes its one buffer by the reported width.
        width = lm.get_aux_hidden_states_width()
        embeds = torch.randn(TOKENS, HIDDEN)
        shared = torch.full((TOKENS + 3, width), float("nan"))
        _, aux = _run(lm.llm, embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(shared[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_idle_batch_takes_no_captures(self):
        shared = torch.full((0, 2 * HIDDEN), float("nan"))
        hidden, aux = _run(
            _model([0, NUM_LAYERS - 1]),
            torch.randn(0, HIDDEN),
            shared,
            mode=ForwardMode.IDLE,
        )
        self.assertIsNone(aux)
        self.assertEqual(tuple(hidden.shape), (0, HIDDEN))

    def test_conditional_generation_reports_the_packed_width(self):
        lm = _causal_lm(_model())
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


def _causal_lm(model):
    lm = InklingForConditionalGeneration.__new__(InklingForConditionalGeneration)
    nn.Module.__init__(lm)
    lm.llm = model
    lm.text_config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
    )
    return lm


if __name__ == "__main__":
    unittest.main()
