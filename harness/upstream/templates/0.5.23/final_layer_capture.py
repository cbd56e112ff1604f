# upstream-path: test/registered/unit/models/test_final_layer_capture.py
"""The last layer's aux capture is taken before or after the final norm, as set.

EAGLE3/DFlash capture index ``end_layer`` is the output of the last decoder
layer. With ``final_layer_capture="pre_norm"`` (the default) a model captures
the stream entering its final norm (hidden_states + residual); with
``"post_norm"`` it captures the final norm's output instead, which is
transformers' ``hidden_states[num_layers]`` and what drafts trained on
``output_hidden_states`` features read there. Every other capture is the same
either way. The setting is --speculative-final-layer-capture when given, else
``final_layer_capture`` in the draft config, else ``"pre_norm"``.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); LlamaModel.forward (a list collector) and
DeepseekV2Model.forward (a packed collector) are the real ones.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.layers import aux_hidden_states
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components import (
    attention_backend_setup,
    spec_aux_hidden_state,
)
from sglang.srt.models.deepseek_v2 import DeepseekV2Model
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.inkling import InklingForConditionalGeneration
from sglang.srt.models.llama import LlamaModel
from sglang.test.aux_capture_test_utils import (
    StreamLayer,
    forward_batch,
    stream_after,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

HIDDEN = 4
TOKENS = 6
NUM_LAYERS = 3
# Capture ids: layer inputs 1 and 2, and NUM_LAYERS, the last layer's output.
CAPTURE_IDS = [1, 2, NUM_LAYERS]


class _FusedAddScaleNorm(nn.Module):
    """Stand-in final norm: ``residual += hidden``, output ``3 * residual - 1``.

    Like the fused GPU kernel it writes both of its inputs in place, so a
    pre-norm capture must be taken from the updated residual, not the output.
    """

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states * 3.0 - 1.0
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 3.0 - 1.0)
        return hidden_states, residual


def _stream_after(embeds, num_layers):
    # The stream after layers 0..num_layers-1: layer k adds 10 * (k + 1).
    return stream_after(embeds, num_layers - 1, step=10.0)


def _build(model_cls, capture_ids, setting=None):
    """The model over stand-in layers; ``setting``: its final-layer capture, as the
    model runner hands it over (None: never set)."""
    returns_topk = model_cls is DeepseekV2Model
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [
            StreamLayer(i, step=10.0, returns_topk=returns_topk)
            for i in range(NUM_LAYERS)
        ]
    )
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(capture_ids)
    model.norm = _FusedAddScaleNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    if returns_topk:
        model.use_dsa = False
        model.first_k_dense_replace = 0
        model.llama_4_scaling_config = None
        model.next_full_attention_layer_id = {}
    if setting is not None:
        aux_hidden_states.set_final_layer_capture(model, setting)
    return model


def _forward(model, embeds, idle=False):
    hidden, aux = model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch(ForwardMode.IDLE if idle else ForwardMode.EXTEND),
        input_embeds=embeds,
    )
    if isinstance(aux, torch.Tensor):
        aux = list(aux.split(HIDDEN, dim=-1))
    return hidden, list(aux)


class TestFinalLayerCapture(CustomTestCase):
    def _captures(self, model_cls, setting):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _forward(_build(model_cls, CAPTURE_IDS, setting), embeds.clone())
        self.assertEqual(len(aux), len(CAPTURE_IDS), "one capture per id")
        # Capture id i < NUM_LAYERS is the input of layer i in both settings.
        for capture, layer_id in zip(aux[:-1], CAPTURE_IDS[:-1]):
            torch.testing.assert_close(capture, _stream_after(embeds, layer_id))
        return embeds, hidden, aux[-1]

    def _check_pre_norm(self, model_cls):
        embeds, hidden, last = self._captures(model_cls, "pre_norm")
        norm_input = _stream_after(embeds, NUM_LAYERS)
        torch.testing.assert_close(last, norm_input)
        torch.testing.assert_close(hidden, norm_input * 3.0 - 1.0)

    def _check_post_norm(self, model_cls):
        embeds, hidden, last = self._captures(model_cls, "post_norm")
        norm_output = _stream_after(embeds, NUM_LAYERS) * 3.0 - 1.0
        torch.testing.assert_close(hidden, norm_output)
        torch.testing.assert_close(last, norm_output)

    def test_default_is_pre_norm(self):
        for model_cls in (LlamaModel, DeepseekV2Model):
            with self.subTest(model=model_cls.__name__):
                model = _build(model_cls, CAPTURE_IDS)
                self.assertFalse(aux_hidden_states.final_layer_capture_post_norm(model))
                embeds = torch.randn(TOKENS, HIDDEN)
                _, aux = _forward(model, embeds.clone())
                torch.testing.assert_close(aux[-1], _stream_after(embeds, NUM_LAYERS))

    def test_the_setting_is_each_models_own(self):
        # Two models in one process (a target and another one), each with its own
        # setting: setting one leaves the other as it was.
        embeds = torch.randn(TOKENS, HIDDEN)
        post = _build(LlamaModel, CAPTURE_IDS, "post_norm")
        pre = _build(LlamaModel, CAPTURE_IDS, "pre_norm")
        unset = _build(LlamaModel, CAPTURE_IDS)
        norm_input = _stream_after(embeds, NUM_LAYERS)
        torch.testing.assert_close(
            _forward(post, embeds.clone())[1][-1], norm_input * 3.0 - 1.0
        )
        torch.testing.assert_close(_forward(pre, embeds.clone())[1][-1], norm_input)
        torch.testing.assert_close(_forward(unset, embeds.clone())[1][-1], norm_input)

    def test_llama_pre_norm(self):
        self._check_pre_norm(LlamaModel)

    def test_llama_post_norm(self):
        self._check_post_norm(LlamaModel)

    def test_deepseek_v2_pre_norm(self):
        self._check_pre_norm(DeepseekV2Model)

    def test_deepseek_v2_post_norm(self):
        self._check_post_norm(DeepseekV2Model)

    def test_deepseek_v2_post_norm_idle_batch(self):
        # An idle batch skips the final norm; the last slot is still filled.
        model = _build(DeepseekV2Model, [1, NUM_LAYERS], "post_norm")
        _, aux = _forward(model, torch.empty(0, HIDDEN), idle=True)
        self.assertEqual([tuple(a.shape) for a in aux], [(0, HIDDEN), (0, HIDDEN)])

    def test_post_norm_without_a_last_layer_capture(self):
        embeds = torch.randn(TOKENS, HIDDEN)
        for model_cls in (LlamaModel, DeepseekV2Model):
            with self.subTest(model=model_cls.__name__):
                model = _build(model_cls, [1, 2], "post_norm")
                _, aux = _forward(model, embeds.clone())
                self.assertEqual(len(aux), 2)
                torch.testing.assert_close(aux[1], _stream_after(embeds, 2))


class TestResolveFinalLayerCapture(CustomTestCase):
    def test_default_is_pre_norm(self):
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(None, None, "eagle_config"),
            "pre_norm",
        )
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(None, {}, "eagle_config"),
            "pre_norm",
        )
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(
                None, {"eagle_aux_hidden_state_layer_ids": [1, 2]}, "eagle_config"
            ),
            "pre_norm",
        )

    def test_draft_config_over_default(self):
        for value in ("pre_norm", "post_norm"):
            with self.subTest(value=value):
                draft = {"target_layer_ids": [0, 3], "final_layer_capture": value}
                self.assertEqual(
                    aux_hidden_states.resolve_final_layer_capture(
                        None, draft, "dflash_config"
                    ),
                    value,
                )

    def test_server_value_over_draft_config(self):
        draft = {"final_layer_capture": "post_norm"}
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(
                "pre_norm", draft, "eagle_config"
            ),
            "pre_norm",
        )
        draft = {"final_layer_capture": "pre_norm"}
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(
                "post_norm", draft, "eagle_config"
            ),
            "post_norm",
        )
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(
                "post_norm", None, "eagle_config"
            ),
            "post_norm",
        )

    def test_draft_config_object(self):
        # A draft config section given as a config object, not a dict.
        draft = types.SimpleNamespace(final_layer_capture="post_norm")
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(None, draft, "eagle_config"),
            "post_norm",
        )
        self.assertEqual(
            aux_hidden_states.resolve_final_layer_capture(
                None, types.SimpleNamespace(), "eagle_config"
            ),
            "pre_norm",
        )

    def test_dspark_draft_config(self):
        # A DSpark draft keeps its fields in dspark_config or top-level dspark_* keys.
        for hf_config, want in (
            ({"dspark_config": {"final_layer_capture": "post_norm"}}, "post_norm"),
            ({"dspark_final_layer_capture": "post_norm"}, "post_norm"),
            (
                {
                    "dflash_config": {"final_layer_capture": "post_norm"},
                    "dspark_config": {"final_layer_capture": "pre_norm"},
                },
                "pre_norm",
            ),
            ({"dflash_config": {"final_layer_capture": "post_norm"}}, "post_norm"),
        ):
            with self.subTest(hf_config=hf_config):
                self.assertEqual(
                    aux_hidden_states.resolve_final_layer_capture(
                        None,
                        *spec_aux_hidden_state._block_draft_capture_config(
                            hf_config, is_dspark=True
                        ),
                    ),
                    want,
                )
        with self.assertRaisesRegex(ValueError, "dspark_config.final_layer_capture"):
            aux_hidden_states.resolve_final_layer_capture(
                None,
                *spec_aux_hidden_state._block_draft_capture_config(
                    {"dspark_final_layer_capture": "after"}, is_dspark=True
                ),
            )

    def test_unknown_values_raise(self):
        with self.assertRaisesRegex(ValueError, "dflash_config.final_layer_capture"):
            aux_hidden_states.resolve_final_layer_capture(
                None, {"final_layer_capture": "after_norm"}, "dflash_config"
            )
        with self.assertRaisesRegex(ValueError, "--speculative-final-layer-capture"):
            aux_hidden_states.resolve_final_layer_capture(
                "postnorm", None, "eagle_config"
            )
        model = _build(LlamaModel, CAPTURE_IDS)
        with self.assertRaises(ValueError):
            aux_hidden_states.set_final_layer_capture(model, "normed")
        self.assertFalse(aux_hidden_states.final_layer_capture_post_norm(model))


class TestInLoopModelsRefusePostNorm(CustomTestCase):
    """Models whose last capture is taken inside the layer loop refuse post_norm
    at start-up, before any setter runs, rather than serve pre_norm silently."""

    def _configure(self, model, value):
        with mock.patch.object(
            attention_backend_setup,
            "get_exec",
            lambda: types.SimpleNamespace(
                overlap=types.SimpleNamespace(enable_two_batch_overlap=False)
            ),
        ):
            attention_backend_setup.configure_aux_hidden_state_capture(
                model=model,
                eagle_use_aux_hidden_state=False,
                eagle_aux_hidden_state_layer_ids=None,
                dflash_use_aux_hidden_state=True,
                dflash_target_layer_ids=[0, 1],
                is_dspark=True,
                final_layer_capture=value,
            )

    def test_refused_at_start_up(self):
        for model_cls in (InklingForConditionalGeneration, DeepseekV4ForCausalLM):
            with self.subTest(model=model_cls.__name__):
                model = model_cls.__new__(model_cls)
                nn.Module.__init__(model)
                calls = []
                model.set_dflash_layers_to_capture = calls.append
                model.set_dspark_layers_to_capture = calls.append
                with self.assertRaisesRegex(ValueError, model_cls.__name__):
                    self._configure(model, "post_norm")
                self.assertEqual(calls, [])
                self.assertFalse(aux_hidden_states.final_layer_capture_post_norm(model))
                self._configure(model, "pre_norm")
                self.assertEqual(calls, [[0, 1]])

    def test_configure_hands_the_setting_to_the_capturing_module(self):
        # The runner's entry point: after the setters, the module that keeps the
        # capture ids holds the setting, and its forward reads it.
        class Wrapper(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = _build(LlamaModel, [])

            def set_dflash_layers_to_capture(self, layer_ids):
                self.model.layers_to_capture = [i + 1 for i in layer_ids]

        wrapper = Wrapper()
        self._configure(wrapper, "post_norm")
        self.assertEqual(wrapper.model.layers_to_capture, [1, 2])
        self.assertTrue(aux_hidden_states.final_layer_capture_post_norm(wrapper.model))
        self.assertFalse(hasattr(wrapper, "final_layer_capture"))


if __name__ == "__main__":
    unittest.main()
