# upstream-path: test/registered/unit/models/test_glm5_next_aux_packer.py
"""Glm5NextModel packs its EAGLE3/DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Glm5NextModel (its layers
capture their input through the ``capture_output`` closure, which contracts
mHC streams under DFlash; the last layer's output is taken at the final norm,
or as a snapshot on an idle batch) collects into AuxHiddenStatePacker instead:
each capture is copied once into its slot of one [T, K * H] buffer, which is
what the forward returns and what pack_aux_hidden_states hands on unchanged.
A DFlash decode CUDA graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by
Glm5NextForConditionalGeneration.get_aux_hidden_states_width.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); Glm5NextModel.forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.glm5_next import (
    Glm5NextForConditionalGeneration,
    Glm5NextModel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
HC_MULT = 2


class _Layer(nn.Module):
    """Completes the previous layer's output at its boundary, captures it when
    asked (``capture_output``, as the attention boundary takes it), and adds
    ``layer_id + 1`` for the next boundary. Returns ``(hidden, topk_indices)``
    as Glm5NextDecoderLayer does."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        *unused_args,
        capture_output=None,
        **unused_kwargs,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        stream = residual_batch.stream_of(forward_batch)
        return stream.record(contribution, PLAIN_ADD), None


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None, **unused_kwargs):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(layers_to_capture=(), mhc=False, dflash=False):
    model = Glm5NextModel.__new__(Glm5NextModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.first_k_dense_replace = 0
    model.enable_a2a_moe = False
    model.dflash_capture = dflash
    model.config = types.SimpleNamespace(mhc=mhc, hc_mult=HC_MULT)
    return model


def _run(model, embeds, buffer=None, idle=False):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.IDLE if idle else ForwardMode.EXTEND,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _stream(embeds, i):
    # capture index i is the output of layer i - 1: embeds + 1 + ... + i
    return embeds + float(sum(range(1, i + 1)))


def _expected(embeds, layers_to_capture):
    return torch.cat([_stream(embeds, i) for i in layers_to_capture], dim=-1)


class TestGlm5NextAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last index is the last layer's output, taken at the final norm.
        layers_to_capture = [1, 3, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN))
        expected = _expected(embeds, layers_to_capture)
        torch.testing.assert_close(aux, expected)
        torch.testing.assert_close(hidden, expected[:, -HIDDEN:] * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_idle_batch_returns_an_empty_packed_buffer(self):
        _, aux = _run(_model([1, NUM_LAYERS]), torch.empty(0, HIDDEN), idle=True)
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (0, 2 * HIDDEN))

    def test_dflash_mhc_captures_are_contracted_into_their_slots(self):
        # Under DFlash an mHC model's layer-input capture is the hc_mult streams
        # contracted to hidden_size (their mean), packed K * hidden wide.
        layers_to_capture = [1, 2]
        streams = torch.randn(TOKENS, HC_MULT * HIDDEN)
        _, aux = _run(_model(layers_to_capture, mhc=True, dflash=True), streams.clone())
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN))
        expected = torch.cat(
            [
                _stream(streams, i).unflatten(-1, (HC_MULT, HIDDEN)).mean(dim=-2)
                for i in layers_to_capture
            ],
            dim=-1,
        )
        torch.testing.assert_close(aux, expected)

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
        lm = Glm5NextForConditionalGeneration.__new__(Glm5NextForConditionalGeneration)
        nn.Module.__init__(lm)
        lm.model = _model()
        lm.config = types.SimpleNamespace(
            hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
        )
        lm.pp_group = types.SimpleNamespace(is_last_rank=True)
        lm.capture_aux_hidden_states = False
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
