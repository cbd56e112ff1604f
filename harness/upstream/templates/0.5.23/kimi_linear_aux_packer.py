# upstream-path: test/registered/unit/models/test_kimi_linear_aux_packer.py
"""KimiLinearModel packs its DSpark aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). KimiLinearModel (capture ids
are layer outputs, each a snapshot after its layer; the last layer's is taken
in the loop, or after the final norm under ``post_norm``) collects into
AuxHiddenStatePacker instead: each capture is copied once into its slot of
one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. Pipeline stages keep the list, as
kimi_k3's do (packs_aux_hidden_states). A DSpark decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
KimiLinearForCausalLM.get_aux_hidden_states_width (0 on a pipeline stage).

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); KimiLinearModel.forward is the real one.
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
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM, KimiLinearModel
from sglang.srt.runtime_context import get_parallel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4


class _Layer(nn.Module):
    """Completes the previous layer's output at its boundary and adds
    ``layer_id + 1``, left to the next boundary (or the final norm)."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch, zero_allocator):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
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


def _model(layer_ids=None):
    model = KimiLinearModel.__new__(KimiLinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.dspark_layers_to_capture = None if layer_ids is None else list(layer_ids)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True, world_size=1
    )
    model.config = types.SimpleNamespace(hidden_size=HIDDEN)
    return model


def _run(model, embeds, buffer=None, pp_proxy_tensors=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=buffer,
    )
    with get_parallel().override(pp_group=model.pp_group):
        return model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=forward_batch,
            inputs_embeds=embeds,
            pp_proxy_tensors=pp_proxy_tensors,
        )


def _after(embeds, layer_id):
    # The output of layer ``layer_id``: embeds + 1 + ... + (layer_id + 1).
    return embeds + float(sum(range(1, layer_id + 2)))


def _expected(embeds, layer_ids):
    return torch.cat([_after(embeds, i) for i in layer_ids], dim=-1)


class TestKimiLinearAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's output (pre_norm: the stream entering
        # the final norm, kept apart from the norm's in-place update).
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layer_ids), embeds.clone())
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
            hidden, aux = _run(_model(layer_ids), embeds.clone())
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
        _, aux = _run(_model(layer_ids), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(shared[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        lm = KimiLinearForCausalLM.__new__(KimiLinearForCausalLM)
        nn.Module.__init__(lm)
        lm.model = _model()
        lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
        lm.capture_aux_hidden_states = False
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dspark_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
