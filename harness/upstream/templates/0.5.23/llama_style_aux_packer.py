# upstream-path: test/registered/unit/models/test_llama_style_aux_packer.py
"""The Apertus, Arcee and Llama 4 models pack their EAGLE3/DFlash aux hidden
states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). ApertusModel, ArceeModel and
Llama4Model collect into AuxHiddenStatePacker instead: each capture, the last
layer's included, is copied once into its slot of one [T, K * H] buffer, which
is what the forward returns and what pack_aux_hidden_states hands on unchanged.
A DFlash decode CUDA graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by each CausalLM's
get_aux_hidden_states_width (Llama4ForCausalLM's own, not the LlamaModel one it
inherits; Llama4ForConditionalGeneration hands on its language model's).

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.apertus import ApertusForCausalLM, ApertusModel
from sglang.srt.models.arcee import ArceeForCausalLM, ArceeModel
from sglang.srt.models.llama4 import Llama4ForCausalLM, Llama4Model
from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4

# Each model with the CausalLM that wraps it.
FAMILY = (
    (ApertusModel, ApertusForCausalLM),
    (ArceeModel, ArceeForCausalLM),
    (Llama4Model, Llama4ForCausalLM),
)


class _Layer(nn.Module):
    """Completes the previous layer's output, captures it when asked, and adds
    ``layer_id + 1`` for the next boundary."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
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


def _model(model_cls, layers_to_capture=()):
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    # Llama4Model runs every layer and has no pipeline stages; the others do.
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND if embeds.shape[0] else ForwardMode.IDLE,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _expected(embeds, layers_to_capture):
    # capture index i is the output of layer i - 1: embeds + 1 + ... + i
    return torch.cat(
        [embeds + float(sum(range(1, i + 1))) for i in layers_to_capture], dim=-1
    )


def _causal_lm(model_cls, lm_cls):
    lm = lm_cls.__new__(lm_cls)
    nn.Module.__init__(lm)
    lm.model = _model(model_cls)
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


class TestLlamaStyleAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        layers_to_capture = [1, 3, NUM_LAYERS]
        for model_cls, _ in FAMILY:
            with self.subTest(model=model_cls.__name__):
                embeds = torch.randn(TOKENS, HIDDEN)
                _, aux = _run(_model(model_cls, layers_to_capture), embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(
                    tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN)
                )
                torch.testing.assert_close(aux, _expected(embeds, layers_to_capture))
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_idle_batch_gives_an_empty_packed_buffer(self):
        # Llama4Model is the one with an idle path (the last capture a snapshot).
        model = _model(Llama4Model, [1, NUM_LAYERS])
        _, aux = _run(model, torch.randn(0, HIDDEN))
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (0, 2 * HIDDEN))

    def test_decode_graph_buffer_is_filled_in_place(self):
        layers_to_capture = [2, NUM_LAYERS]
        for model_cls, _ in FAMILY:
            with self.subTest(model=model_cls.__name__):
                embeds = torch.randn(TOKENS, HIDDEN)
                shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
                model = _model(model_cls, layers_to_capture)
                _, aux = _run(model, embeds.clone(), shared[:TOKENS])
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                torch.testing.assert_close(
                    shared[:TOKENS], _expected(embeds, layers_to_capture)
                )
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        for model_cls, _ in FAMILY:
            with self.subTest(model=model_cls.__name__):
                out = _run(_model(model_cls), torch.randn(TOKENS, HIDDEN))
                self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        for model_cls, lm_cls in FAMILY:
            with self.subTest(model=lm_cls.__name__):
                lm = _causal_lm(model_cls, lm_cls)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_llama4_wrapper_reports_its_language_models_width(self):
        # Llama 4 checkpoints load as Llama4ForConditionalGeneration, whose forward
        # runs its language model's (Llama4ForCausalLM over Llama4Model).
        wrapper = Llama4ForConditionalGeneration.__new__(Llama4ForConditionalGeneration)
        nn.Module.__init__(wrapper)
        wrapper.language_model = _causal_lm(Llama4Model, Llama4ForCausalLM)
        self.assertEqual(wrapper.get_aux_hidden_states_width(), 0)
        wrapper.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(wrapper.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
