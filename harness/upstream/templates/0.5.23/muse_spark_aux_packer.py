# upstream-path: test/registered/unit/models/test_muse_spark_aux_packer.py
"""MuseSpark1xModel packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). MuseSpark1xModel (capture ids
are layer outputs, taken after each layer from its fp32 residual stream in
operator dtype, the last layer's in the loop or, under ``post_norm``, the
final norm's output) collects into AuxHiddenStatePacker instead: each capture
is cast straight into its slot of one [T, K * H] buffer in operator dtype
(what the list held, and what the draft's context projection reads), which is
what the forward returns and what pack_aux_hidden_states hands on unchanged.
A DFlash decode CUDA graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by
MuseSparkTextForCausalLM.get_aux_hidden_states_width (which the omni
MuseSparkForConditionalGeneration inherits).

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins with MuseSpark1xDecoderLayer's interface (the fp32 stream updated
in place, and the next layer's attention input in operator dtype) and the
final norm updates its input in place; MuseSpark1xModel.forward is the real
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
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.muse_spark import (
    MuseSpark1xModel,
    MuseSparkModel,
    MuseSparkTextForCausalLM,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
OPERATOR_DTYPE = torch.bfloat16
RESIDUAL_DTYPE = torch.float32


class _Layer(nn.Module):
    """MuseSpark1xDecoderLayer's interface: adds ``layer_id + 1`` to the
    residual stream in place (as its fused norm boundaries write it) and
    returns it with the next layer's attention input (None after the last)."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def self_attn_input_norm(self, stream):
        return stream.to(OPERATOR_DTYPE)

    def forward(self, positions, stream, attn_input, forward_batch):
        stream.add_(float(self.layer_id + 1))
        if self.layer_id == NUM_LAYERS - 1:
            return stream, None
        return stream, self.self_attn_input_norm(stream)


class _InPlaceNorm(nn.Module):
    """A final norm that overwrites its input, as a fused kernel may."""

    def forward(self, hidden_states):
        return hidden_states.mul_(0.5)


def _model(layers_to_capture=()):
    model = MuseSpark1xModel.__new__(MuseSpark1xModel)
    nn.Module.__init__(model)
    model.operator_dtype = OPERATOR_DTYPE
    model.residual_dtype = RESIDUAL_DTYPE
    model.embed_norm = None
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.norm = _InPlaceNorm()
    model.layers_to_capture = list(layers_to_capture)
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, aux_hidden_states_buffer=buffer
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _stream_after(embeds, layer_id):
    # The fp32 stream after layer ``layer_id``: embeds + 1 + ... + (layer_id + 1).
    return embeds.to(RESIDUAL_DTYPE) + float(sum(range(1, layer_id + 2)))


def _expected(embeds, layer_ids):
    # What the list held: each stream cast to operator dtype.
    return torch.cat(
        [_stream_after(embeds, i).to(OPERATOR_DTYPE) for i in layer_ids], dim=-1
    )


def _embeds():
    return torch.randn(TOKENS, HIDDEN).mul(3.0).to(OPERATOR_DTYPE)


def _causal_lm():
    lm = MuseSparkTextForCausalLM.__new__(MuseSparkTextForCausalLM)
    nn.Module.__init__(lm)
    lm.model = MuseSparkModel.__new__(MuseSparkModel)
    nn.Module.__init__(lm.model)
    lm.model.language_model = _model()
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm.capture_aux_hidden_states = False
    return lm


class TestMuseSparkAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer_in_operator_dtype(self):
        # The last id is the last layer's output (pre_norm: the stream
        # entering the final norm).
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = _embeds()
        hidden, aux = _run(_model(layer_ids), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(aux.dtype, OPERATOR_DTYPE)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        self.assertTrue(torch.equal(aux, _expected(embeds, layer_ids)))
        final = _stream_after(embeds, NUM_LAYERS - 1).to(OPERATOR_DTYPE) * 0.5
        self.assertTrue(torch.equal(hidden, final))
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_fills_the_last_slot(self):
        layer_ids = [1, NUM_LAYERS - 1]
        embeds = _embeds()
        set_final_layer_capture("post_norm")
        try:
            hidden, aux = _run(_model(layer_ids), embeds.clone())
        finally:
            set_final_layer_capture("pre_norm")
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(aux.dtype, OPERATOR_DTYPE)
        self.assertEqual(tuple(aux.shape), (TOKENS, 2 * HIDDEN))
        first, last = aux.split(HIDDEN, dim=-1)
        self.assertTrue(torch.equal(first, _expected(embeds, [1])))
        final = _stream_after(embeds, NUM_LAYERS - 1).to(OPERATOR_DTYPE) * 0.5
        self.assertTrue(torch.equal(last, final))
        self.assertTrue(torch.equal(last, hidden))
        self.assertNotEqual(
            aux.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()
        )

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = [0, NUM_LAYERS - 1]
        embeds = _embeds()
        shared = torch.full(
            (TOKENS + 3, 2 * HIDDEN), float("nan"), dtype=OPERATOR_DTYPE
        )
        _, aux = _run(_model(layer_ids), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        self.assertTrue(torch.equal(shared[:TOKENS], _expected(embeds, layer_ids)))
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_buffer_not_in_operator_dtype_is_refused(self):
        # The captures are operator dtype; a buffer of the residual dtype is
        # not filled with something the draft does not expect.
        shared = torch.zeros(TOKENS, 2 * HIDDEN, dtype=RESIDUAL_DTYPE)
        with self.assertRaises(ValueError):
            _run(_model([0, NUM_LAYERS - 1]), _embeds(), shared)

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), _embeds())
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        lm = _causal_lm()
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
