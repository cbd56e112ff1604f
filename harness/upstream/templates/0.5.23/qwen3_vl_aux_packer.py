# upstream-path: test/registered/unit/models/test_qwen3_vl_aux_packer.py
"""The Qwen3-VL language models pack their EAGLE3/DFlash aux hidden states into
one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Qwen3LLMModel (Qwen3-VL) and
Qwen3MoeLLMModel (Qwen3-VL-MoE) collect into AuxHiddenStatePacker instead: each
capture, the last layer's included, is copied once into its slot of one
[T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
each wrapper's get_aux_hidden_states_width; a wrapper over a language model of
another class reports 0.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward is the real one,
deepstack included.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration
from sglang.srt.models.qwen3_vl_moe import (
    Qwen3MoeLLMModel,
    Qwen3VLMoeForConditionalGeneration,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
NUM_DEEPSTACK = 3

# Each language model with the wrapper that runs it.
FAMILY = (
    (Qwen3LLMModel, Qwen3VLForConditionalGeneration),
    (Qwen3MoeLLMModel, Qwen3VLMoeForConditionalGeneration),
)


class _Layer(nn.Module):
    """Completes the previous layer's output, captures it when asked, and adds
    ``layer_id + 1`` for the next boundary."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self, positions, hidden_states, forward_batch, capture_output=None, **unused
    ):
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


class _ListLanguageModel(nn.Module):
    """A language model of another class that counts its captures but whose
    forward may still return a list (as Qwen3.5's and Qwen4-Exp's do)."""

    def __init__(self):
        super().__init__()
        self.start_layer, self.end_layer = 0, NUM_LAYERS
        self.layers_to_capture = []

    def num_aux_captures(self):
        return len(self.layers_to_capture)


def _model(model_cls, layers_to_capture=()):
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.hidden_size = HIDDEN
    model.deepstack_embed_to_decoder_layer = range(NUM_DEEPSTACK)
    model.use_hf_deepstack_order = False
    return model


def _run(model, embeds, buffer=None, deepstack=None):
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
        input_deepstack_embeds=deepstack,
    )


def _expected(embeds, layers_to_capture, deepstack=None):
    # capture index i is the output of layer i - 1: embeds + 1 + ... + i, plus
    # the deepstack embeddings added after each of layers 0 .. i - 1 that take one
    captures = []
    for i in layers_to_capture:
        capture = embeds + float(sum(range(1, i + 1)))
        if deepstack is not None:
            for j in range(min(i, NUM_DEEPSTACK)):
                capture = capture + deepstack[:, j * HIDDEN : (j + 1) * HIDDEN]
        captures.append(capture)
    return torch.cat(captures, dim=-1)


def _wrapper(wrapper_cls, language_model):
    wrapper = wrapper_cls.__new__(wrapper_cls)
    nn.Module.__init__(wrapper)
    wrapper.model = language_model
    wrapper.config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
    )
    wrapper.pp_group = types.SimpleNamespace(is_last_rank=True)
    wrapper.capture_aux_hidden_states = False
    return wrapper


class TestQwen3VLAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        layers_to_capture = [1, 3, NUM_LAYERS]
        for model_cls, _ in FAMILY:
            for with_deepstack in (False, True):
                with self.subTest(model=model_cls.__name__, deepstack=with_deepstack):
                    embeds = torch.randn(TOKENS, HIDDEN)
                    deepstack = (
                        torch.randn(TOKENS, NUM_DEEPSTACK * HIDDEN)
                        if with_deepstack
                        else None
                    )
                    model = _model(model_cls, layers_to_capture)
                    _, aux = _run(model, embeds.clone(), deepstack=deepstack)
                    self.assertIsInstance(aux, torch.Tensor)
                    self.assertEqual(
                        tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN)
                    )
                    torch.testing.assert_close(
                        aux, _expected(embeds, layers_to_capture, deepstack)
                    )
                    # The logits processor hands it on as it is: no concatenation.
                    self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_idle_batch_gives_an_empty_packed_buffer(self):
        layers_to_capture = [1, NUM_LAYERS]
        for model_cls, _ in FAMILY:
            with self.subTest(model=model_cls.__name__):
                model = _model(model_cls, layers_to_capture)
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

    def test_wrapper_reports_the_packed_width(self):
        for model_cls, wrapper_cls in FAMILY:
            with self.subTest(model=wrapper_cls.__name__):
                wrapper = _wrapper(wrapper_cls, _model(model_cls))
                self.assertEqual(wrapper.get_aux_hidden_states_width(), 0)
                wrapper.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                self.assertEqual(wrapper.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_wrapper_over_another_language_model_reports_no_width(self):
        # Subclasses such as Qwen3.5's and Qwen4-Exp's wrappers run a language
        # model of their own: no decode graph buffer for a forward that may not
        # fill it.
        for _, wrapper_cls in FAMILY:
            with self.subTest(model=wrapper_cls.__name__):
                wrapper = _wrapper(wrapper_cls, _ListLanguageModel())
                wrapper.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                self.assertTrue(wrapper.capture_aux_hidden_states)
                self.assertEqual(wrapper.get_aux_hidden_states_width(), 0)


if __name__ == "__main__":
    unittest.main()
