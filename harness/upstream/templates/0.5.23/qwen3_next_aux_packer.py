# upstream-path: test/registered/unit/models/test_qwen3_next_aux_packer.py
"""The Qwen3-Next and Qwen3.5 models pack their EAGLE3/DFlash aux hidden states
into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Qwen3NextModel,
Qwen3_5ForCausalLM (run by Qwen3_5MoeForCausalLM too) and
InternS2MobiusForCausalLM collect into AuxHiddenStatePacker instead: each
capture, the last layer's included, is copied once into its slot of one
[T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
the get_aux_hidden_states_width of the class the model runner holds:
Qwen3NextForCausalLM, the Qwen3.5 wrappers (vision-language and text-only) and
Intern-S2-Mobius's. Qwen4-Exp, whose forward returns its captures only on an
idle batch, reports none.

Runs on CPU without a GPU or a checkpoint: the hybrid (linear-attention and
full-attention) decoder layers and the final norm are small stand-ins on the
real residual stream (``forward_batch.residual_stream``); each model's forward
is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components.misc_utils import (
    resolve_aux_hidden_states_width,
)
from sglang.srt.models import qwen3_5_text
from sglang.srt.models.interns2_mobius import (
    InternS2MobiusForCausalLM,
    InternS2MobiusForConditionalGeneration,
)
from sglang.srt.models.minicpmv import (
    MiniCPMV4_6,
    MiniCPMV4_6ForConditionalGeneration,
)
from sglang.srt.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextModel
from sglang.srt.models.qwen4_exp import (
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpVLModel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4

# Each model with the classes the model runner holds around it.
FAMILY = (
    (Qwen3NextModel, (Qwen3NextForCausalLM,)),
    (
        Qwen3_5ForCausalLM,
        (Qwen3_5ForConditionalGeneration, qwen3_5_text.Qwen3_5ForCausalLM),
    ),
    (
        Qwen3_5MoeForCausalLM,
        (Qwen3_5MoeForConditionalGeneration, qwen3_5_text.Qwen3_5MoeForCausalLM),
    ),
    (InternS2MobiusForCausalLM, (InternS2MobiusForConditionalGeneration,)),
)


class _Layer(nn.Module):
    """Completes the previous layer's output, captures it into the collector the
    model hands it (``captured_last_layer_outputs``), and adds ``layer_id + 1``
    for the next boundary; it stands in for linear- and full-attention layers
    alike."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self,
        positions=None,
        hidden_states=None,
        forward_batch=None,
        captured_last_layer_outputs=None,
        **unused_kwargs,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(hidden_states)
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
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True, world_size=1
    )
    if issubclass(model_cls, Qwen3_5ForCausalLM):
        # start_layer and end_layer are properties over these
        model._start_layer, model._end_layer = 0, NUM_LAYERS
        model.hidden_size = HIDDEN
        model.flashinfer_mnnvl_cutedsl_fusion = None
        model.meta_mlp = nn.ModuleList()
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND if embeds.shape[0] else ForwardMode.IDLE,
        aux_hidden_states_buffer=buffer,
    )
    # The fourth argument is the input embeddings (input_embeds or
    # inputs_embeds, depending on the model).
    return model.forward(None, torch.arange(embeds.shape[0]), forward_batch, embeds)


def _expected(embeds, layers_to_capture):
    # capture index i is the output of layer i - 1: embeds + 1 + ... + i
    return torch.cat(
        [embeds + float(sum(range(1, i + 1))) for i in layers_to_capture], dim=-1
    )


def _holder(holder_cls, model):
    holder = holder_cls.__new__(holder_cls)
    nn.Module.__init__(holder)
    holder.model = model
    holder.config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
    )
    holder.pp_group = types.SimpleNamespace(is_last_rank=True, world_size=1)
    holder.capture_aux_hidden_states = False
    return holder


class TestQwen3NextAuxPacker(CustomTestCase):
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

    def test_holder_reports_the_packed_width(self):
        for model_cls, holder_classes in FAMILY:
            for holder_cls in holder_classes:
                with self.subTest(model=holder_cls.__name__):
                    holder = _holder(holder_cls, _model(model_cls))
                    self.assertEqual(holder.get_aux_hidden_states_width(), 0)
                    holder.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                    self.assertEqual(holder.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_minicpmv_4_6_reports_the_packed_width(self):
        # The model runner holds the version dispatcher, which forwards
        # attribute reads to the 4.6 model around a Qwen3.5 body.
        inner = MiniCPMV4_6.__new__(MiniCPMV4_6)
        nn.Module.__init__(inner)
        inner.llm = _model(Qwen3_5ForCausalLM)
        inner.config = types.SimpleNamespace(
            text_config=types.SimpleNamespace(hidden_size=HIDDEN)
        )
        inner.capture_aux_hidden_states = False
        runner_model = MiniCPMV4_6ForConditionalGeneration.__new__(
            MiniCPMV4_6ForConditionalGeneration
        )
        runner_model.minicpmv = inner
        dflash = types.SimpleNamespace(is_dflash_family=lambda: True)

        def width():
            return resolve_aux_hidden_states_width(
                model=runner_model, spec_algorithm=dflash, is_draft_worker=False
            )

        self.assertEqual(width(), 0)
        runner_model.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(width(), 3 * HIDDEN)

    def test_qwen4_exp_reports_no_width(self):
        # Its forward returns the captures only on an idle batch: no decode
        # graph buffer for it to leave unfilled.
        # Captures set on the holder and model directly, as a setter would (its own
        # setters may refuse ids: its decoder layers write no captures).
        holder = _holder(
            Qwen4ExpForConditionalGeneration,
            _model(Qwen4ExpVLModel, [1, 3, NUM_LAYERS]),
        )
        holder.capture_aux_hidden_states = True
        dflash = types.SimpleNamespace(is_dflash_family=lambda: True)
        self.assertEqual(
            resolve_aux_hidden_states_width(
                model=holder, spec_algorithm=dflash, is_draft_worker=False
            ),
            0,
        )


if __name__ == "__main__":
    unittest.main()
