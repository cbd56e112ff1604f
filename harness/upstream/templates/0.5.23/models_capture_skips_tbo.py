# upstream-path: test/registered/unit/models/test_aux_capture_skips_tbo.py
"""A capturing model runs its layers outside two-batch overlap.

With two-batch overlap (TBO), deepseek_v2 (its sparse layers) and qwen3_moe
(Qwen2MoeModel.forward over Qwen3MoeDecoderLayer) run their layers through
``model_forward_stages``, whose stages take no EAGLE3/DFlash captures: the
captures of those layers were dropped without an error. A model that captures
must run every layer in the plain loop when the batch could run TBO; a model
that does not capture still overlaps. glm5_next (whose guard covered DFlash
only) and minimax_m3 (no guard) get the same gate; OperationsStrategy has no
TBO plan for their layer classes today, so for them it is a guard against the
day it has one.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``), and ``model_forward_stages`` is replaced
by a mock that runs the layers in order without captures, as its stages do.
Each model's forward is the real one.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.models import deepseek_v2, glm5_next, minimax_m3, qwen2_moe
from sglang.test.aux_capture_test_utils import StreamLayer, forward_batch, stream_after
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 3


class _Norm(nn.Module):
    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states * 0.5
        residual = hidden_states + residual
        return residual * 0.5, residual


def _model_forward_stages(
    layers, enable_tbo, positions, forward_batch, hidden_states, **kwargs
):
    """Runs the layers in order and, like the overlapped stages, captures nothing."""
    for layer in layers:
        hidden_states = layer(
            positions=positions,
            hidden_states=hidden_states,
            forward_batch=forward_batch,
        )
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
    return hidden_states


def _bare(model_cls, returns_topk):
    """``model_cls`` without its __init__: stand-in layers and norm, one stage."""
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [StreamLayer(i, returns_topk=returns_topk) for i in range(NUM_LAYERS)]
    )
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.norm = _Norm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _qwen2_moe(layers_to_capture):
    model = _bare(qwen2_moe.Qwen2MoeModel, False)
    model.set_eagle3_layers_to_capture(list(layers_to_capture))
    return model


def _deepseek_v2(layers_to_capture):
    model = _bare(deepseek_v2.DeepseekV2Model, True)
    model.layers_to_capture = list(layers_to_capture)
    model.use_dsa = False
    # the dense layer runs in the plain loop, the sparse ones overlap
    model.first_k_dense_replace = 1
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    return model


def _glm5_next(layers_to_capture):
    model = _bare(glm5_next.Glm5NextModel, True)
    # EAGLE3 ids: its own guard covered DFlash (dflash_capture) only
    model.layers_to_capture = list(layers_to_capture)
    model.dflash_capture = False
    model.enable_a2a_moe = False
    model.config = types.SimpleNamespace(mhc=False)
    model.first_k_dense_replace = 1
    return model


def _minimax_m3(layers_to_capture):
    model = _bare(minimax_m3.MiniMaxM3Model, False)
    model.layers_to_capture = list(layers_to_capture)
    # its forward reads the flags its CausalLM's setter sets
    for layer_id in layers_to_capture:
        if layer_id < NUM_LAYERS:
            model.layers[layer_id]._is_layer_to_capture = True
    model.finalize_norm = None
    return model


_MODULES = {
    qwen2_moe.Qwen2MoeModel: qwen2_moe,
    deepseek_v2.DeepseekV2Model: deepseek_v2,
    glm5_next.Glm5NextModel: glm5_next,
    minimax_m3.MiniMaxM3Model: minimax_m3,
}


def _run(model, embeds):
    batch = forward_batch()
    batch.can_run_tbo = True  # a batch two-batch overlap would take
    module = _MODULES[type(model)]
    with mock.patch.object(
        module, "model_forward_stages", side_effect=_model_forward_stages
    ) as stages:
        out = model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=batch,
            input_embeds=embeds,
        )
    return out, stages


_output_of = stream_after


class TestModelsCaptureSkipsTbo(CustomTestCase):
    def _check(self, build, layers_to_capture):
        embeds = torch.randn(TOKENS, HIDDEN)
        out, stages = _run(build(layers_to_capture), embeds.clone())
        stages.assert_not_called()
        self.assertIsInstance(out, tuple, "the captures were dropped")
        hidden, aux = out
        if isinstance(aux, torch.Tensor):
            aux = aux.split(HIDDEN, dim=-1)
        self.assertEqual(len(aux), len(layers_to_capture))
        # capture index i is the output of layer i - 1
        for capture, layer_id in zip(aux, layers_to_capture):
            torch.testing.assert_close(capture, _output_of(embeds, layer_id - 1))
        torch.testing.assert_close(hidden, _output_of(embeds, NUM_LAYERS - 1) * 0.5)

    def _check_overlaps(self, build):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, stages = _run(build([]), embeds.clone())
        stages.assert_called_once()
        self.assertTrue(stages.call_args.kwargs["enable_tbo"])
        torch.testing.assert_close(hidden, _output_of(embeds, NUM_LAYERS - 1) * 0.5)

    def test_capturing_qwen2_moe_runs_outside_tbo(self):
        self._check(_qwen2_moe, [1, 2])

    def test_capturing_deepseek_v2_runs_outside_tbo(self):
        self._check(_deepseek_v2, [1, 2])

    def test_capturing_glm5_next_eagle3_runs_outside_tbo(self):
        self._check(_glm5_next, [1, 2])

    def test_capturing_minimax_m3_runs_outside_tbo(self):
        self._check(_minimax_m3, [1, 2])

    def test_non_capturing_glm5_next_and_minimax_m3_overlap(self):
        for build in (_glm5_next, _minimax_m3):
            with self.subTest(model=build.__name__):
                self._check_overlaps(build)

    def test_non_capturing_qwen2_moe_overlaps(self):
        self._check_overlaps(_qwen2_moe)

    def test_non_capturing_deepseek_v2_overlaps(self):
        self._check_overlaps(_deepseek_v2)


if __name__ == "__main__":
    unittest.main()
