# upstream-path: test/registered/unit/models/test_final_layer_capture.py
"""What a capture holds where a convention decides it, as the draft asks.

The last layer. EAGLE3/DFlash capture index ``end_layer`` is the output of the
last decoder layer. With ``final_layer_capture="pre_norm"`` (the default) a
model captures the stream entering its final norm (hidden_states + residual);
with ``"post_norm"`` it captures the final norm's output instead, which is
transformers' ``hidden_states[num_layers]`` and what drafts trained on
``output_hidden_states`` features read there. Every other capture is the same
either way. The setting is --speculative-final-layer-capture when given, else
``final_layer_capture`` in the draft config, else ``"pre_norm"``. Where it
cannot apply (no aux hidden states, draft ids that leave the last layer out, a
model that keeps no capture ids of its own) configure_aux_hidden_state_capture
says so once. BeamModel takes the last capture inside its layer loops; both
loops take it after the norm under post_norm (the fused loop's last transition
already produces the norm's output). Models that cannot (inkling,
deepseek_v4) refuse post_norm at start-up.

Qwen3-VL's deepstack. Qwen3-VL adds deepstack embeddings to the output of
decoder layers 0-2, so a capture of index k <= 3 is taken next to that
addition. The inference path adds them to the layer output and captures the
stream entering the next layer (deepstack included); the HF-order path
(use_hf_deepstack_order, under --rl-on-policy-target) passes them as
post_residual_addition and its boundary captures before the read adds them.
Unset, each order keeps its own side (the inference path "post_deepstack",
the HF-order path "pre_deepstack"); ``deepstack_capture`` makes both orders
capture the side it names, and comes from --speculative-deepstack-capture or
the draft config. A "pre_deepstack" capture on the inference path is taken
before the addition, so it is the layer's output bit for bit, not the sum with
the deepstack subtracted again.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``, sglang.test.aux_capture_test_utils); the
forwards (Llama, DeepSeek-V2, the MoE, hybrid, looped, top-k and Qwen3-VL
loops, and kimi_linear, whose ids name layer outputs), the setters and the
model runner's start-up are the real ones; BeamModel runs its real decoder
layers (norms and fused transitions) over stand-in attention and MLP, with a
final norm whose weight is not 1.
"""

import inspect
import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.configs.beam import BeamConfig
from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_executor import model_runner
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components import (
    attention_backend_setup,
    spec_aux_hidden_state,
)
from sglang.srt.models import beam
from sglang.srt.models.deepseek_v2 import DeepseekV2Model
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.glm4_moe import Glm4MoeModel
from sglang.srt.models.glm5_next import Glm5NextModel
from sglang.srt.models.granitemoehybrid import GraniteMoeHybridModel
from sglang.srt.models.inkling import InklingForConditionalGeneration
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM, KimiLinearModel
from sglang.srt.models.llama import LlamaForCausalLM, LlamaModel
from sglang.srt.models.longcat_flash import LongcatFlashModel
from sglang.srt.models.nanbeige import NanbeigeModel
from sglang.srt.models.qwen2_moe import Qwen2MoeModel
from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeModel
from sglang.srt.models.qwen3_next import Qwen3NextModel
from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration
from sglang.srt.models.qwen3_vl_moe import (
    Qwen3MoeLLMModel,
    Qwen3VLMoeForConditionalGeneration,
)
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.test.aux_capture_test_utils import (
    InPlaceNorm,
    StreamLayer,
    forward_batch,
    stream_after,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

HIDDEN = 4
TOKENS = 6
NUM_LAYERS = 3
# Capture ids: layer inputs 1 and 2, and NUM_LAYERS, the last layer's output.
CAPTURE_IDS = [1, 2, NUM_LAYERS]


def _without_tbo():
    """The model runner's execution settings with two-batch overlap off, where
    configure_aux_hidden_state_capture reads them."""
    return mock.patch.object(
        attention_backend_setup,
        "get_exec",
        lambda: types.SimpleNamespace(
            overlap=types.SimpleNamespace(enable_two_batch_overlap=False)
        ),
    )


def _configure(model, **capture):
    """configure_aux_hidden_state_capture, the model runner's entry point, without
    two-batch overlap; ``capture``: its capture arguments (none requested unless
    given)."""
    kwargs = dict(
        eagle_use_aux_hidden_state=False,
        eagle_aux_hidden_state_layer_ids=None,
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
    )
    kwargs.update(capture)
    with _without_tbo():
        attention_backend_setup.configure_aux_hidden_state_capture(
            model=model, **kwargs
        )


class _FusedAddScaleNorm(nn.Module):
    """Stand-in final norm: ``residual += hidden``, output ``3 * residual - 1``.

    Like the fused GPU kernel it writes both of its inputs in place, so a
    pre-norm capture must be taken from the updated residual, not the output.
    """

    def forward(self, hidden_states, residual=None, **unused_kwargs):
        if residual is None:
            return hidden_states * 3.0 - 1.0
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 3.0 - 1.0)
        return hidden_states, residual


def _stream_after(embeds, num_layers):
    # The stream after layers 0..num_layers-1: layer k adds 10 * (k + 1).
    return stream_after(embeds, num_layers - 1, step=10.0)


# The forwards whose layers return top-k routing beside the stream.
TOPK_FORWARDS = (DeepseekV2Model, Glm5NextModel, LongcatFlashModel)

# Forwards that take the last layer's capture at their final norm, each with a
# post_norm branch of its own, beyond LlamaModel and DeepseekV2Model: MoE, hybrid
# (linear attention, Mamba), looped, top-k and multimodal language-model loops.
FINAL_NORM_FORWARDS = (
    Glm4MoeModel,
    Glm5NextModel,
    GraniteMoeHybridModel,
    LongcatFlashModel,
    NanbeigeModel,
    Qwen2MoeModel,
    Qwen3MoeModel,
    Qwen3NextModel,
    Qwen3_5ForCausalLM,
    Qwen3LLMModel,
    KimiLinearModel,
)


def _build(model_cls, capture_ids, setting=None):
    """The model over stand-in layers; ``setting``: its final-layer capture, as the
    model runner hands it over (None: never set)."""
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [
            StreamLayer(i, step=10.0, returns_topk=model_cls in TOPK_FORWARDS)
            for i in range(NUM_LAYERS)
        ]
    )
    if isinstance(model, Qwen3_5ForCausalLM):  # properties over these
        model._start_layer, model._end_layer = 0, NUM_LAYERS
    else:
        model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(capture_ids)
    model.norm = _FusedAddScaleNorm()
    model.pp_group = types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True, world_size=1
    )
    # Attributes the forwards read (their __init__ is not run).
    model.config = types.SimpleNamespace(
        num_loops=1,
        num_hidden_layers=NUM_LAYERS,
        skip_loop_final_norm=True,
        mhc=False,
        embedding_multiplier=1.0,
    )
    model.use_dsa = False
    model.first_k_dense_replace = 0
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    model.dflash_capture = False
    model.enable_a2a_moe = False
    model.meta_mlp = None
    model.hidden_size = HIDDEN
    model.embedding_multiplier = 1.0
    model.flashinfer_mnnvl_cutedsl_fusion = None
    model.use_hf_deepstack_order = False
    if model_cls is KimiLinearModel:
        # DSpark ids name layer outputs: the last one is taken inside the loop,
        # or, under post_norm, as the final norm's output after it.
        model.dspark_layers_to_capture = [i - 1 for i in capture_ids]
        model.config.hidden_size = HIDDEN
    if setting is not None:
        aux_hidden_states.set_final_layer_capture(model, setting)
    return model


def _forward(model, embeds, idle=False):
    # Some forwards name it inputs_embeds.
    embeds_arg = (
        "inputs_embeds"
        if "inputs_embeds" in inspect.signature(model.forward).parameters
        else "input_embeds"
    )
    # One pipeline stage, as the model's own group says (kimi_linear reads it).
    with get_parallel().override(pp_group=model.pp_group):
        hidden, aux = model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=forward_batch(
                ForwardMode.IDLE if idle else ForwardMode.EXTEND
            ),
            **{embeds_arg: embeds},
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

    def test_every_final_norm_forward(self):
        for model_cls in FINAL_NORM_FORWARDS:
            with self.subTest(model=model_cls.__name__):
                self._check_pre_norm(model_cls)
                self._check_post_norm(model_cls)

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
    """Models that cannot take the final norm's output as their last capture
    (inkling's is taken before its layer's deferred short convolution, inside
    the loop; deepseek_v4's final norm follows its hyper-connection head) refuse
    post_norm at start-up, before any setter runs, rather than serve pre_norm
    silently."""

    def _configure(self, model, value):
        _configure(
            model,
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


# A post_norm that cannot apply is said once.
WARN_LAYERS = 8


class _LanguageModel(nn.Module):
    def __init__(self, attr):
        super().__init__()
        setattr(self, attr, [] if attr == "layers_to_capture" else None)


def _ids_holder(cls, attr):
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = _LanguageModel(attr)
    lm.config = types.SimpleNamespace(hidden_size=8, num_hidden_layers=WARN_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


def _llama_ids():
    return _ids_holder(LlamaForCausalLM, "layers_to_capture")


def _kimi_linear_ids():
    # DSpark only: its model keeps the ids in dspark_layers_to_capture.
    return _ids_holder(KimiLinearForCausalLM, "dspark_layers_to_capture")


class _External(nn.Module):
    """A model whose captures another package takes (as MindSporeForCausalLM's)."""

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.requested = layer_ids


class TestFinalLayerCaptureIgnored(CustomTestCase):
    def _warnings(self, model, eagle3=None, dflash=None, dspark=False):
        with mock.patch.object(attention_backend_setup.logger, "warning") as warning:
            _configure(
                model,
                eagle_use_aux_hidden_state=eagle3 is not None,
                eagle_aux_hidden_state_layer_ids=(
                    None if eagle3 == "default" else eagle3
                ),
                dflash_use_aux_hidden_state=dflash is not None,
                dflash_target_layer_ids=dflash,
                is_dspark=dspark,
                final_layer_capture="post_norm",
                num_layers=WARN_LAYERS,
            )
        return [
            call.args[0]
            for call in warning.call_args_list
            if "final_layer_capture='post_norm' is ignored" in call.args[0]
        ]

    def test_without_a_last_layer_capture_it_warns_once(self):
        for eagle3, dflash, why in (
            (None, None, "takes no aux hidden states"),
            ("default", None, "the default [2, L // 2, L - 3] do not include"),
            ([0, 1, 2], None, "[0, 1, 2] do not include the target's last layer (7)"),
            (None, [0, 2], "[0, 2] do not include the target's last layer (7)"),
        ):
            with self.subTest(eagle3=eagle3, dflash=dflash):
                warned = self._warnings(_llama_ids(), eagle3=eagle3, dflash=dflash)
                self.assertEqual(len(warned), 1, warned)
                self.assertIn(why, warned[0])

    def test_a_model_without_layers_to_capture_warns(self):
        model = _External()
        warned = self._warnings(model, eagle3=[0, 1, WARN_LAYERS - 1])
        self.assertEqual(model.requested, [0, 1, WARN_LAYERS - 1])
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("_External keeps no layers_to_capture", warned[0])

    def test_no_warning_with_the_last_layer(self):
        self.assertEqual(
            self._warnings(_llama_ids(), eagle3=[0, 1, WARN_LAYERS - 1]), []
        )
        self.assertEqual(self._warnings(_llama_ids(), dflash=[1, WARN_LAYERS - 1]), [])

    def test_dspark_ids_in_dspark_layers_to_capture(self):
        warned = self._warnings(_kimi_linear_ids(), dflash=[0, 2], dspark=True)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("[0, 2] do not include the target's last layer (7)", warned[0])
        model = _kimi_linear_ids()
        self.assertEqual(
            self._warnings(model, dflash=[1, WARN_LAYERS - 1], dspark=True), []
        )
        self.assertEqual(model.model.dspark_layers_to_capture, [1, WARN_LAYERS - 1])


# BeamModel: both layer loops, real decoder layers over stand-in attention and MLP.
BEAM_HIDDEN = 8
BEAM_LAYERS = 4
BEAM_IDS = (1, BEAM_LAYERS - 1)  # layer outputs; the last one's capture is the question


class _BeamLinear(nn.Module):
    """Stands in for BeamAttention and BeamMLP: a fixed per-instance linear map."""

    seed = 0

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        _BeamLinear.seed += 1
        g = torch.Generator().manual_seed(_BeamLinear.seed)
        self.weight = (
            torch.randn(config.hidden_size, config.hidden_size, generator=g) / 3
        )

    def forward(self, *args, **kwargs):
        hidden = args[1] if len(args) > 1 else args[0]
        return torch.tanh(hidden @ self.weight)


def _beam(fused):
    config = BeamConfig(
        vocab_size=32,
        hidden_size=BEAM_HIDDEN,
        intermediate_size=16,
        num_hidden_layers=BEAM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=4,
        mlp_layer_types=["dense"] * BEAM_LAYERS,
    )
    with (
        mock.patch.object(beam, "BeamAttention", _BeamLinear),
        mock.patch.object(beam, "BeamMLP", _BeamLinear),
        mock.patch.object(
            beam, "get_parallel", lambda: types.SimpleNamespace(attn_dp_size=1)
        ),
    ):
        layers = nn.ModuleList(
            beam.BeamDecoderLayer(config, i, prefix=f"layers.{i}")
            for i in range(BEAM_LAYERS)
        )
    model = beam.BeamModel.__new__(beam.BeamModel)
    nn.Module.__init__(model)
    model.config, model.layers = config, layers
    model.start_layer, model.end_layer = 0, BEAM_LAYERS
    model.norm = RMSNorm(BEAM_HIDDEN, eps=config.rms_norm_eps)
    model.norm.weight.data = torch.linspace(0.5, 1.5, BEAM_HIDDEN)
    model.pp_group = types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True, world_size=1
    )
    model.has_full_attention = True
    model.layers_to_capture = BEAM_IDS
    model.fuse_moe_all_reduce = False
    model._beam_all_reduce_comm = None
    model.fuse_layers = fused
    model._flashinfer_ar_tokens = None
    model._flashinfer_ar = None
    model._mlp_has_single_tp_sum = True
    return model


def _beam_run(model, embeds, value):
    aux_hidden_states.set_final_layer_capture(model, value)
    with torch.no_grad():
        return model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=types.SimpleNamespace(aux_hidden_states_buffer=None),
            input_embeds=embeds,
        )


class TestBeamPostNormCapture(CustomTestCase):
    def test_last_capture_is_the_final_norms_output(self):
        embeds = torch.randn(TOKENS, BEAM_HIDDEN)
        for loop, fused in (("plain", False), ("fused", True)):
            with self.subTest(loop=loop):
                model = _beam(fused)
                hidden_pre, aux_pre = _beam_run(model, embeds.clone(), "pre_norm")
                hidden, aux = _beam_run(model, embeds.clone(), "post_norm")
                torch.testing.assert_close(hidden, hidden_pre)
                torch.testing.assert_close(
                    aux[:, :BEAM_HIDDEN], aux_pre[:, :BEAM_HIDDEN]
                )
                last_pre_norm = aux_pre[:, BEAM_HIDDEN:]
                torch.testing.assert_close(
                    aux[:, BEAM_HIDDEN:], model.norm(last_pre_norm)
                )
                torch.testing.assert_close(aux[:, BEAM_HIDDEN:], hidden)

    def test_model_runner_configures_post_norm(self):
        # The model runner configures the captures once the server args are
        # published.
        server_args = get_context().override_server_args()
        server_args.install()
        self.addCleanup(server_args.restore)
        model = beam.BeamForCausalLM.__new__(beam.BeamForCausalLM)
        nn.Module.__init__(model)
        model.model = _beam(fused=True)
        model.model.layers_to_capture = ()
        model.config = model.model.config
        model.capture_aux_hidden_states = False
        _configure(
            model,
            dflash_use_aux_hidden_state=True,
            dflash_target_layer_ids=list(BEAM_IDS),
            final_layer_capture="post_norm",
        )
        self.assertEqual(tuple(model.model.layers_to_capture), BEAM_IDS)
        self.assertTrue(aux_hidden_states.final_layer_capture_post_norm(model.model))


# Qwen3-VL: captures next to the deepstack addition.
VL_HIDDEN = 8
VL_LAYERS = 4
NUM_DEEPSTACK = 3
VL_CAPTURED = [1, 2, 3, VL_LAYERS]

# Each language model with the wrapper that runs it.
FAMILY = (
    (Qwen3LLMModel, Qwen3VLForConditionalGeneration),
    (Qwen3MoeLLMModel, Qwen3VLMoeForConditionalGeneration),
)


class _DeepstackLayer(nn.Module):
    """Completes the previous layer's output and captures it when asked, before a
    ``post_residual_addition`` joins the stream (as the attention boundary
    captures before its read), then adds ``layer_id + 1`` for the next boundary."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        post_residual_addition=None,
        capture_output=None,
        **unused,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        if post_residual_addition is not None:
            hidden_states = residual_batch.set_written(
                hidden_states + post_residual_addition, forward_batch
            )
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        return residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)


def _vl_model(model_cls, hf_order):
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_DeepstackLayer(i) for i in range(VL_LAYERS)])
    model.start_layer, model.end_layer = 0, VL_LAYERS
    model.layers_to_capture = list(VL_CAPTURED)
    model.norm = InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.hidden_size = VL_HIDDEN
    model.deepstack_embed_to_decoder_layer = range(NUM_DEEPSTACK)
    model.use_hf_deepstack_order = hf_order
    return model


def _vl_captures(model, embeds, deepstack):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=None,
    )
    _, aux = model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
        input_deepstack_embeds=deepstack,
    )
    return aux


def _vl_expected(embeds, deepstack, post):
    # Capture index i: the output of layer i - 1 (embeds + 1 + ... + i) with the
    # deepstack of layers 0 .. i - 2 in it; "post_deepstack" adds layer i - 1's.
    captures = []
    for i in VL_CAPTURED:
        with_deepstack = min(i if post or i == VL_LAYERS else i - 1, NUM_DEEPSTACK)
        capture = embeds + float(sum(range(1, i + 1)))
        for j in range(with_deepstack):
            capture = capture + deepstack[:, j * VL_HIDDEN : (j + 1) * VL_HIDDEN]
        captures.append(capture)
    return torch.cat(captures, dim=-1)


def _vl_wrapper(wrapper_cls, language_model):
    wrapper = wrapper_cls.__new__(wrapper_cls)
    nn.Module.__init__(wrapper)
    wrapper.model = language_model
    wrapper.config = types.SimpleNamespace(
        hidden_size=VL_HIDDEN, num_hidden_layers=VL_LAYERS
    )
    wrapper.pp_group = types.SimpleNamespace(is_last_rank=True)
    wrapper.capture_aux_hidden_states = False
    return wrapper


def _configure_deepstack(model, deepstack_capture):
    _configure(
        model,
        eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=[i - 1 for i in VL_CAPTURED],
        deepstack_capture=deepstack_capture,
    )


class TestQwen3VLDeepstackCapture(CustomTestCase):
    def _check(self, setting, post, orders=(False, True)):
        for model_cls, wrapper_cls in FAMILY:
            for hf_order in orders:
                with self.subTest(
                    model=model_cls.__name__, hf_order=hf_order, setting=setting
                ):
                    torch.manual_seed(0)
                    embeds = torch.randn(TOKENS, VL_HIDDEN)
                    deepstack = torch.randn(TOKENS, NUM_DEEPSTACK * VL_HIDDEN)
                    model = _vl_model(model_cls, hf_order)
                    _configure_deepstack(_vl_wrapper(wrapper_cls, model), setting)
                    self.assertEqual(model.layers_to_capture, VL_CAPTURED)
                    torch.testing.assert_close(
                        _vl_captures(model, embeds.clone(), deepstack),
                        _vl_expected(embeds, deepstack, post),
                    )

    def test_unset_keeps_each_order_its_own_side(self):
        for hf_order in (False, True):
            self._check(None, post=not hf_order, orders=(hf_order,))

    def test_post_deepstack_on_both_orders(self):
        self._check("post_deepstack", post=True)

    def test_pre_deepstack_takes_the_previous_layer_output_on_both_orders(self):
        self._check("pre_deepstack", post=False)

    def test_pre_deepstack_is_the_layer_output_bit_for_bit(self):
        # Layer j's output does not depend on its own deepstack: the capture after it
        # must equal, bit for bit, that of a forward whose deepstack j alone is zero.
        # Large deepstack values make (x + d) - d differ from x in the last bits.
        for dtype in (torch.bfloat16, torch.float32):
            for model_cls, wrapper_cls in FAMILY:
                for hf_order in (False, True):
                    with self.subTest(
                        model=model_cls.__name__, hf_order=hf_order, dtype=dtype
                    ):
                        torch.manual_seed(1)
                        embeds = torch.randn(TOKENS, VL_HIDDEN).to(dtype)
                        deepstack = (
                            torch.randn(TOKENS, NUM_DEEPSTACK * VL_HIDDEN) * 300
                        ).to(dtype)
                        model = _vl_model(model_cls, hf_order)
                        _configure_deepstack(
                            _vl_wrapper(wrapper_cls, model), "pre_deepstack"
                        )
                        got = _vl_captures(model, embeds.clone(), deepstack)
                        for j in range(NUM_DEEPSTACK):
                            zeroed = deepstack.clone()
                            zeroed[:, j * VL_HIDDEN : (j + 1) * VL_HIDDEN] = 0
                            alone = _vl_captures(model, embeds.clone(), zeroed)
                            k = VL_CAPTURED.index(j + 1)
                            cols = slice(k * VL_HIDDEN, (k + 1) * VL_HIDDEN)
                            self.assertTrue(
                                torch.equal(got[:, cols], alone[:, cols]), (j, dtype)
                            )

    def test_text_only_batches_are_unchanged(self):
        for model_cls, _ in FAMILY:
            for hf_order in (False, True):
                with self.subTest(model=model_cls.__name__, hf_order=hf_order):
                    embeds = torch.randn(TOKENS, VL_HIDDEN)
                    model = _vl_model(model_cls, hf_order)
                    model.set_deepstack_capture("pre_deepstack")
                    torch.testing.assert_close(
                        _vl_captures(model, embeds.clone(), None),
                        _vl_expected(
                            embeds, torch.zeros(TOKENS, NUM_DEEPSTACK * VL_HIDDEN), True
                        ),
                    )


class TestDeepstackCaptureSetting(CustomTestCase):
    def test_server_value_over_draft_config_over_model_default(self):
        draft = {"deepstack_capture": "pre_deepstack"}
        self.assertIsNone(
            aux_hidden_states.resolve_deepstack_capture(None, None, "eagle_config")
        )
        self.assertIsNone(
            aux_hidden_states.resolve_deepstack_capture(None, {}, "eagle_config")
        )
        self.assertEqual(
            aux_hidden_states.resolve_deepstack_capture(None, draft, "eagle_config"),
            "pre_deepstack",
        )
        self.assertEqual(
            aux_hidden_states.resolve_deepstack_capture(
                "post_deepstack", draft, "eagle_config"
            ),
            "post_deepstack",
        )

    def test_unknown_values_raise_naming_their_source(self):
        with self.assertRaisesRegex(ValueError, "dflash_config.deepstack_capture"):
            aux_hidden_states.resolve_deepstack_capture(
                None, {"deepstack_capture": "after"}, "dflash_config"
            )
        with self.assertRaisesRegex(ValueError, "--speculative-deepstack-capture"):
            aux_hidden_states.resolve_deepstack_capture("pre", None, "eagle_config")
        model = _vl_model(Qwen3LLMModel, False)
        with self.assertRaisesRegex(ValueError, "deepstack_capture"):
            model.set_deepstack_capture("PRE_DEEPSTACK")
        self.assertIsNone(model.deepstack_capture_post)

    def test_a_model_without_deepstack_logs_that_it_is_ignored(self):
        model = nn.Linear(2, 2)
        model.set_eagle3_layers_to_capture = lambda layer_ids=None: None
        with self.assertLogs(attention_backend_setup.logger, "WARNING") as logs:
            _configure_deepstack(model, "pre_deepstack")
        self.assertIn("deepstack_capture='pre_deepstack' is ignored", logs.output[0])


class _Stop(Exception):
    """Ends ModelRunner.init_attention_backends after it has configured the captures."""


def _init_capture(model, **settings):
    """ModelRunner.init_attention_backends on ``model`` with a resolved
    SpecAuxHiddenStateConfig of EAGLE3 ids and ``settings`` (what the draft config
    or the server arguments asked for): it configures the aux hidden state
    capture first, then the backends, which this stops before building."""
    config = dict(
        eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=None,
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
        final_layer_capture="pre_norm",
        deepstack_capture=None,
        target_num_layers=None,
    )
    config.update(settings)
    runner = types.SimpleNamespace(
        model=model, spec_aux_config=types.SimpleNamespace(**config)
    )
    with (
        _without_tbo(),
        mock.patch.object(
            model_runner, "resolve_attention_backend_strs", side_effect=_Stop
        ),
    ):
        try:
            model_runner.ModelRunner.init_attention_backends(runner)
        except _Stop:
            return
    raise AssertionError("init_attention_backends did not reach the backends")


class _EagleWrapper(nn.Module):
    """A CausalLM over a language model: its EAGLE3 setter takes layer-input ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [i + 1 for i in layer_ids]


class TestTheModelRunnerServesTheDraftsSetting(CustomTestCase):
    """What a draft asks for reaches the forward through the model runner's own
    start-up: the captures it gets are the side it asked for."""

    def test_post_norm_last_capture(self):
        wrapper = _EagleWrapper(_build(LlamaModel, []))
        _init_capture(
            wrapper,
            eagle_aux_hidden_state_layer_ids=[i - 1 for i in CAPTURE_IDS],
            final_layer_capture="post_norm",
            target_num_layers=NUM_LAYERS,
        )
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _forward(wrapper.model, embeds.clone())
        norm_output = _stream_after(embeds, NUM_LAYERS) * 3.0 - 1.0
        torch.testing.assert_close(aux[-1], norm_output)
        torch.testing.assert_close(hidden, norm_output)

    def test_pre_deepstack_captures_on_the_inference_path(self):
        for model_cls, wrapper_cls in FAMILY:
            with self.subTest(model=model_cls.__name__):
                torch.manual_seed(0)
                embeds = torch.randn(TOKENS, VL_HIDDEN)
                deepstack = torch.randn(TOKENS, NUM_DEEPSTACK * VL_HIDDEN)
                model = _vl_model(model_cls, hf_order=False)
                _init_capture(
                    _vl_wrapper(wrapper_cls, model),
                    eagle_aux_hidden_state_layer_ids=[i - 1 for i in VL_CAPTURED],
                    deepstack_capture="pre_deepstack",
                    target_num_layers=VL_LAYERS,
                )
                torch.testing.assert_close(
                    _vl_captures(model, embeds.clone(), deepstack),
                    _vl_expected(embeds, deepstack, post=False),
                )


if __name__ == "__main__":
    unittest.main()
