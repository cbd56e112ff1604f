# upstream-path: test/registered/unit/models/test_nemotron_h_aux_packer.py
"""NemotronHModel packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). NemotronHModel collects into
AuxHiddenStatePacker instead: each capture (the stream entering a Mamba,
attention, MLP or MoE layer, taken by its boundary's ``capture_output``, and
the last layer's output before or after the final norm) is copied once into
its slot of one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
NemotronHForCausalLM.get_aux_hidden_states_width (and the Nano VL wrapper's,
which delegates to it).

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins (one per layer kind of the hybrid pattern, each an instance of its
real class, with the real StageBoundary.capture_output) on the real residual
stream (``forward_batch.residual_stream``), and the final norm is a stand-in;
NemotronHModel.forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.layers.layer_boundary.stage import StageBoundary
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.nemotron_h import (
    NemotronHAttentionDecoderLayer,
    NemotronHForCausalLM,
    NemotronHMambaDecoderLayer,
    NemotronHMLPDecoderLayer,
    NemotronHModel,
    NemotronHMoEDecoderLayer,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
# Mamba, MLP, attention, MoE: one layer of each kind, as hybrid_override_pattern
# "M-*E" builds them.
LAYER_CLASSES = (
    NemotronHMambaDecoderLayer,
    NemotronHMLPDecoderLayer,
    NemotronHAttentionDecoderLayer,
    NemotronHMoEDecoderLayer,
)
NUM_LAYERS = len(LAYER_CLASSES)


def _layer(layer_cls, layer_id):
    """An instance of the real decoder layer class (NemotronHModel.forward
    refuses any other) whose forward completes the previous layer's output and
    adds ``layer_id + 1`` for the next boundary; its boundary's capture_output
    is the real one."""

    class _StandIn(layer_cls):
        def __init__(self):
            nn.Module.__init__(self)
            self.layer_id = layer_id
            self.boundary = StageBoundary.__new__(StageBoundary)

        def forward(self, *, hidden_states, forward_batch):
            hidden_states = residual_batch.fold(hidden_states, forward_batch)
            contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
            stream = residual_batch.stream_of(forward_batch)
            return stream.record(contribution, PLAIN_ADD)

    return _StandIn()


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(layers_to_capture=()):
    model = NemotronHModel.__new__(NemotronHModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [_layer(cls, i) for i, cls in enumerate(LAYER_CLASSES)]
    )
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = set(layers_to_capture)
    model.norm_f = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        inputs_embeds=embeds,
    )


def _expected(embeds, layers_to_capture):
    # capture index i is the output of layer i - 1: embeds + 1 + ... + i
    return torch.cat(
        [embeds + float(sum(range(1, i + 1))) for i in sorted(layers_to_capture)],
        dim=-1,
    )


class TestNemotronHAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # Index 1 enters the MLP layer, 2 the attention layer, 3 the MoE layer;
        # the last index is the last layer's output, taken at the final norm.
        layers_to_capture = [1, 2, 3, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN))
        expected = _expected(embeds, layers_to_capture)
        torch.testing.assert_close(aux, expected)
        torch.testing.assert_close(hidden, expected[:, -HIDDEN:] * 0.5)
        # The logits processor hands it on as it is: no concatenation.
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_is_the_final_norm_output(self):
        # The draft's choice of the last layer's capture (--speculative-final-
        # layer-capture): post_norm takes the final norm's output.
        from sglang.srt.layers.aux_hidden_states import set_final_layer_capture

        layers_to_capture = [2, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        set_final_layer_capture("post_norm")
        try:
            hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        finally:
            set_final_layer_capture("pre_norm")
        self.assertIsInstance(aux, torch.Tensor)
        torch.testing.assert_close(aux[:, :HIDDEN], _expected(embeds, [2]))
        torch.testing.assert_close(aux[:, HIDDEN:], hidden)

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

    def _causal_lm(self):
        lm = NemotronHForCausalLM.__new__(NemotronHForCausalLM)
        nn.Module.__init__(lm)
        lm.model = _model()
        lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
        lm.pp_group = types.SimpleNamespace(is_last_rank=True)
        lm.capture_aux_hidden_states = False
        return lm

    def test_causal_lm_reports_the_packed_width(self):
        lm = self._causal_lm()
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_nano_vl_wrapper_reports_its_language_model_width(self):
        from sglang.srt.models.nano_nemotron_vl import NemotronH_Nano_VL_V2

        lm = self._causal_lm()
        vl = NemotronH_Nano_VL_V2.__new__(NemotronH_Nano_VL_V2)
        nn.Module.__init__(vl)
        vl.language_model = lm
        self.assertEqual(vl.get_aux_hidden_states_width(), 0)
        vl.set_dflash_layers_to_capture([1, NUM_LAYERS - 1])
        self.assertEqual(vl.get_aux_hidden_states_width(), 2 * HIDDEN)

    def test_mtp_draft_reports_no_width(self):
        # The MTP draft subclass holds a NemotronHMultiTokenPredictor and never
        # captures (nor sets capture_aux_hidden_states).
        from sglang.srt.models.nemotron_h_mtp import NemotronHForCausalLMMTP

        mtp = NemotronHForCausalLMMTP.__new__(NemotronHForCausalLMMTP)
        nn.Module.__init__(mtp)
        mtp.model = nn.Module()
        self.assertEqual(mtp.get_aux_hidden_states_width(), 0)


if __name__ == "__main__":
    unittest.main()
