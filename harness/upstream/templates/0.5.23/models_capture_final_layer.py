# upstream-path: test/registered/unit/models/test_aux_capture_final_layer.py
"""Capturing models capture the final layer's output when it is requested.

EAGLE3/DFlash capture index i is the input of layer i, so index ``end_layer``
(the output of the last layer, which DFlash layer ids and EAGLE3 ids that
include the last layer request) is never reached inside the layer loop. The
model must capture it at the final norm (the residual the fused add + norm
updates, not the norm's output), and on an idle batch (which skips the final
norm) too. The models that flag their capturing layers must accept that
index. One case per distinct forward: deepseek_v2 (whose last capture is
its packer's last slot), the list models, the flag models
through their setters, the looped (nanbeige), top-k (glm5_next), folded
(granitemoehybrid), plain-norm (muse_glimmer) and subclass (interns2_mobius)
forwards.

With two-batch overlap (TBO), deepseek_v2 (its sparse layers) and qwen3_moe
(Qwen2MoeModel.forward over Qwen3MoeDecoderLayer) run their layers through
``model_forward_stages``, whose stages take no captures: those captures were
dropped without an error. A model that captures runs every layer in the plain
loop when the batch could run TBO; one that does not capture still overlaps.
glm5_next (whose guard covered DFlash only) and minimax_m3 (no guard) get the
same gate.

qwen2_moe (whose forward qwen3_moe runs too), qwen3_next and qwen3_5 kept a
second record of what to capture: their setters flagged each layer
(``_is_layer_to_capture``) and the forward handed the capture list only to a
flagged layer. Code that sets ``layers_to_capture`` itself, as the Qwen3-VL
wrapper does for a language model without a setter, got a forward that
captured nothing inside its layer loop; and a list changed after the setter
ran still captured at the layers flagged before. The forward must capture
index i at the input of layer i exactly when i is in the list.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward is the real one, and
``model_forward_stages`` is replaced by a mock that runs the layers in order
without captures, as its stages do.
"""

import inspect
import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import deepseek_v2, glm5_next, minimax_m3, qwen2_moe
from sglang.srt.models.deepseek_v2 import DeepseekV2Model
from sglang.srt.models.glm4_moe import Glm4MoeModel
from sglang.srt.models.glm5_next import Glm5NextModel
from sglang.srt.models.granitemoehybrid import GraniteMoeHybridModel
from sglang.srt.models.interns2_mobius import InternS2MobiusForCausalLM
from sglang.srt.models.llama import LlamaModel
from sglang.srt.models.longcat_flash import LongcatFlashModel
from sglang.srt.models.muse_glimmer import MuseGlimmerForCausalLM, MuseGlimmerModel
from sglang.srt.models.nanbeige import NanbeigeModel
from sglang.srt.models.qwen2_moe import Qwen2MoeModel
from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeModel
from sglang.srt.models.qwen3_next import Qwen3NextModel
from sglang.srt.models.qwen3_vl import Qwen3LLMModel
from sglang.test.aux_capture_test_utils import (
    InPlaceNorm,
    StreamLayer,
    forward_batch,
    stream_after,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 3


class _PlainLayer(nn.Module):
    """A layer that returns the whole stream (no residual stream)."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch):
        return hidden_states + float(self.layer_id + 1)


class _PlainNorm(nn.Module):
    def forward(self, hidden_states):
        return hidden_states * 0.5


def _model(model_cls, layers_to_capture=()):
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [
            StreamLayer(
                i,
                returns_topk=model_cls
                in (DeepseekV2Model, Glm5NextModel, LongcatFlashModel),
            )
            for i in range(NUM_LAYERS)
        ]
    )
    if isinstance(model, Qwen3_5ForCausalLM):  # properties over these
        model._start_layer, model._end_layer = 0, NUM_LAYERS
    else:
        model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.first_k_dense_replace = 0
    # Per-model attributes the forwards read (their __init__ is not run).
    model.config = types.SimpleNamespace(
        num_loops=1,
        num_hidden_layers=NUM_LAYERS,
        skip_loop_final_norm=True,
        mhc=False,
        embedding_multiplier=1.0,
    )
    model.dflash_capture = False
    model.enable_a2a_moe = False
    model.meta_mlp = None
    model.hidden_size = HIDDEN
    model.embedding_multiplier = 1.0
    model.flashinfer_mnnvl_cutedsl_fusion = None
    model.use_hf_deepstack_order = False
    model.use_dsa = False
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    return model


def _muse_glimmer(layers_to_capture):
    model = MuseGlimmerModel.__new__(MuseGlimmerModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_PlainLayer(i) for i in range(NUM_LAYERS)])
    model.norm = _PlainNorm()
    model.embed_norm = None
    wrapper = MuseGlimmerForCausalLM.__new__(MuseGlimmerForCausalLM)
    nn.Module.__init__(wrapper)
    wrapper.model = model
    # The wrapper's setter takes layer-input ids, as the model runner maps them.
    wrapper.set_dflash_layers_to_capture(list(layers_to_capture))
    return model


def _run(model, embeds, idle=False):
    batch = forward_batch(ForwardMode.IDLE if idle else ForwardMode.EXTEND)
    # Some forwards name it inputs_embeds.
    embeds_arg = (
        "inputs_embeds"
        if "inputs_embeds" in inspect.signature(model.forward).parameters
        else "input_embeds"
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=batch,
        **{embeds_arg: embeds},
    )


def _captures(aux):
    """The captures one by one, from a list or from a packed [T, K * H] tensor."""
    return aux.split(HIDDEN, dim=-1) if isinstance(aux, torch.Tensor) else aux


_output_of = stream_after


class TestModelsCaptureFinalLayer(CustomTestCase):
    def _check_captures(self, model, layers_to_capture):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(model, embeds.clone())
        aux = _captures(aux)
        self.assertEqual(
            len(aux), len(layers_to_capture), "expected one capture per layer"
        )
        # capture index i is the output of layer i - 1
        for capture, layer_id in zip(aux, layers_to_capture):
            torch.testing.assert_close(capture, _output_of(embeds, layer_id - 1))
        # the norm halves the residual it updates in place; the final capture
        # is that updated residual, not the norm's output
        torch.testing.assert_close(hidden, aux[-1] * 0.5)

    def test_deepseek_v2(self):
        for layers_to_capture in ([1, 2, NUM_LAYERS], [1, NUM_LAYERS]):
            with self.subTest(layers_to_capture=layers_to_capture):
                model = _model(DeepseekV2Model, layers_to_capture)
                self._check_captures(model, layers_to_capture)

    def test_deepseek_v2_idle_batch(self):
        model = _model(DeepseekV2Model, [1, NUM_LAYERS])
        _, aux = _run(model, torch.empty(0, HIDDEN), idle=True)
        self.assertEqual(tuple(aux.shape), (0, 2 * HIDDEN))

    def test_llama(self):
        layers_to_capture = [1, 2, NUM_LAYERS]
        self._check_captures(_model(LlamaModel, layers_to_capture), layers_to_capture)

    def test_glm4_moe(self):
        layers_to_capture = [1, NUM_LAYERS]
        self._check_captures(_model(Glm4MoeModel, layers_to_capture), layers_to_capture)

    def test_glm4_moe_idle_batch(self):
        model = _model(Glm4MoeModel, [1, NUM_LAYERS])
        _, aux = _run(model, torch.empty(0, HIDDEN), idle=True)
        self.assertEqual(len(_captures(aux)), 2, "expected one capture per layer")

    def test_qwen2_moe_eagle3_layers(self):
        layers_to_capture = [1, NUM_LAYERS]
        model = _model(Qwen2MoeModel)
        model.set_eagle3_layers_to_capture(layers_to_capture)
        self._check_captures(model, layers_to_capture)

    def test_qwen3_moe_dflash_layers(self):
        layers_to_capture = [1, 2, NUM_LAYERS]
        model = _model(Qwen3MoeModel)
        model.set_dflash_layers_to_capture(layers_to_capture)
        self._check_captures(model, layers_to_capture)

    def test_every_list_forward(self):
        # Each of these forwards captures by the list; one distinct path each.
        for model_cls in (
            GraniteMoeHybridModel,  # folds the stream before an unfused norm
            LongcatFlashModel,  # collects into an AuxHiddenStateList
            Qwen3LLMModel,  # qwen3_vl's language model (deepstack unused)
            Glm5NextModel,  # layers return top-k indices
            NanbeigeModel,  # looped: the last unrolled id
        ):
            with self.subTest(model=model_cls.__name__):
                layers_to_capture = [1, NUM_LAYERS]
                model = _model(model_cls, layers_to_capture)
                self._check_captures(model, layers_to_capture)

    def test_interns2_mobius_through_qwen3_5_setters(self):
        # Its own forward over qwen3_5's layers, set up by qwen3_5's setters (as
        # its wrappers do).
        for setter in ("set_eagle3_layers_to_capture", "set_dflash_layers_to_capture"):
            with self.subTest(setter=setter):
                layers_to_capture = [1, NUM_LAYERS]
                model = _model(InternS2MobiusForCausalLM)
                getattr(model, setter)(layers_to_capture)
                self._check_captures(model, layers_to_capture)

    def test_every_flag_setter(self):
        for model_cls, setter in (
            (Qwen3NextModel, "set_eagle3_layers_to_capture"),
            (Qwen3_5ForCausalLM, "set_dflash_layers_to_capture"),
        ):
            with self.subTest(model=model_cls.__name__, setter=setter):
                layers_to_capture = [1, NUM_LAYERS]
                model = _model(model_cls)
                getattr(model, setter)(layers_to_capture)
                self._check_captures(model, layers_to_capture)

    def test_muse_glimmer_takes_the_last_layer(self):
        # Plain layers and an unfused norm: the last layer's output is the
        # norm's input, and the setter must accept its id.
        embeds = torch.randn(TOKENS, HIDDEN)
        model = _muse_glimmer([1, NUM_LAYERS])
        hidden, aux = _run(model, embeds.clone())
        aux = _captures(aux)
        self.assertEqual(len(aux), 2, "expected one capture per layer")
        torch.testing.assert_close(aux[0], _output_of(embeds, 0))
        torch.testing.assert_close(aux[1], _output_of(embeds, NUM_LAYERS - 1))
        torch.testing.assert_close(hidden, aux[1] * 0.5)

    def test_no_final_capture_when_not_requested(self):
        layers_to_capture = [1, 2]
        for model_cls in (DeepseekV2Model, LlamaModel, Glm4MoeModel):
            with self.subTest(model=model_cls.__name__):
                model = _model(model_cls, layers_to_capture)
                _, aux = _run(model, torch.randn(TOKENS, HIDDEN))
                self.assertEqual(len(_captures(aux)), 2)


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


def _qwen2_moe(layers_to_capture):
    model = _model(qwen2_moe.Qwen2MoeModel)
    model.set_eagle3_layers_to_capture(list(layers_to_capture))
    return model


def _deepseek_v2(layers_to_capture):
    model = _model(deepseek_v2.DeepseekV2Model, layers_to_capture)
    # the dense layer runs in the plain loop, the sparse ones overlap
    model.first_k_dense_replace = 1
    return model


def _glm5_next(layers_to_capture):
    # EAGLE3 ids: its own guard covered DFlash (dflash_capture) only
    model = _model(glm5_next.Glm5NextModel, layers_to_capture)
    model.first_k_dense_replace = 1
    return model


def _minimax_m3(layers_to_capture):
    model = _model(minimax_m3.MiniMaxM3Model, layers_to_capture)
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


def _tbo_run(model, embeds):
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


class TestModelsCaptureSkipsTbo(CustomTestCase):
    def _check(self, build, layers_to_capture):
        embeds = torch.randn(TOKENS, HIDDEN)
        out, stages = _tbo_run(build(layers_to_capture), embeds.clone())
        stages.assert_not_called()
        self.assertIsInstance(out, tuple, "the captures were dropped")
        hidden, aux = out
        if isinstance(aux, torch.Tensor):
            aux = aux.split(HIDDEN, dim=-1)
        self.assertEqual(len(aux), len(layers_to_capture))
        # capture index i is the output of layer i - 1
        for capture, layer_id in zip(aux, layers_to_capture):
            torch.testing.assert_close(capture, stream_after(embeds, layer_id - 1))
        torch.testing.assert_close(hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5)

    def _check_overlaps(self, build):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, stages = _tbo_run(build([]), embeds.clone())
        stages.assert_called_once()
        self.assertTrue(stages.call_args.kwargs["enable_tbo"])
        torch.testing.assert_close(hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5)

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


# The models whose forward decided the in-loop captures by a per-layer flag.
FLAG_FORWARDS = (
    Qwen2MoeModel,
    Qwen3MoeModel,
    Qwen3NextModel,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
)


class TestModelsCaptureByIndex(CustomTestCase):
    def _check_captures(self, model, layers_to_capture):
        embeds = torch.randn(TOKENS, HIDDEN)
        out = _run(model, embeds.clone())
        # A model returns the captures only when it took some.
        hidden, aux = out if isinstance(out, tuple) else (out, [])
        aux = _captures(aux)
        self.assertEqual(
            len(aux),
            len(layers_to_capture),
            f"{len(aux)} of {len(layers_to_capture)} requested captures came out",
        )
        for capture, layer_id in zip(aux, layers_to_capture):
            torch.testing.assert_close(capture, _output_of(embeds, layer_id - 1))
        torch.testing.assert_close(hidden, _output_of(embeds, NUM_LAYERS - 1) * 0.5)

    def test_list_set_without_setter(self):
        # The list alone, as a wrapper sets it on its language model; with and
        # without the final layer (taken after the loop).
        for layers_to_capture in ([1, 2], [1, NUM_LAYERS]):
            for model_cls in FLAG_FORWARDS:
                with self.subTest(model=model_cls.__name__, ids=layers_to_capture):
                    model = _model(model_cls, layers_to_capture)
                    self._check_captures(model, layers_to_capture)

    def test_list_changed_after_setter(self):
        # The list replaced after a setter ran is what the forward captures.
        for model_cls in FLAG_FORWARDS:
            with self.subTest(model=model_cls.__name__):
                model = _model(model_cls)
                if hasattr(model, "set_eagle3_layers_to_capture"):
                    model.set_eagle3_layers_to_capture([0, 1])
                else:
                    model.set_dflash_layers_to_capture([0, 1])
                model.layers_to_capture = [2]
                self._check_captures(model, [2])

    def test_setters_request_the_same_captures(self):
        layers_to_capture = [1, 2, NUM_LAYERS]
        for model_cls in FLAG_FORWARDS:
            for setter in (
                "set_eagle3_layers_to_capture",
                "set_dflash_layers_to_capture",
            ):
                if not hasattr(model_cls, setter):
                    continue
                with self.subTest(model=model_cls.__name__, setter=setter):
                    model = _model(model_cls)
                    getattr(model, setter)(list(layers_to_capture))
                    self._check_captures(model, layers_to_capture)


if __name__ == "__main__":
    unittest.main()
