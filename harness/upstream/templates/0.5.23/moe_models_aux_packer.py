# upstream-path: test/registered/unit/models/test_moe_models_aux_packer.py
"""The EXAONE-MoE, LongCat-Flash and Bailing-MoE models pack their EAGLE3/DFlash
aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). ExaoneMoEModel,
LongcatFlashModel and BailingMoEModel collect into AuxHiddenStatePacker instead:
each capture, the last layer's included, is copied once into its slot of one
[T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
each CausalLM's get_aux_hidden_states_width; the draft classes built on them
report 0.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward is the real one.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import exaone_moe
from sglang.srt.models.bailing_moe import (
    BailingMoEForCausalLM,
    BailingMoEModel,
    BailingMoeForCausalLM,
    BailingMoeV2ForCausalLM,
)
from sglang.srt.models.exaone_moe import (
    ExaoneMoEForCausalLM,
    ExaoneMoEModel,
    ExaoneMoeForCausalLM,
)
from sglang.srt.models.exaone_moe_mtp import ExaoneMoEForCausalLMMTP
from sglang.srt.models.longcat_flash import LongcatFlashForCausalLM, LongcatFlashModel
from sglang.srt.models.longcat_flash_nextn import LongcatFlashForCausalLMNextN
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4

# Each model with the CausalLMs that wrap it.
FAMILY = (
    (ExaoneMoEModel, (ExaoneMoEForCausalLM, ExaoneMoeForCausalLM)),
    (LongcatFlashModel, (LongcatFlashForCausalLM,)),
    (
        BailingMoEModel,
        (BailingMoEForCausalLM, BailingMoeForCausalLM, BailingMoeV2ForCausalLM),
    ),
)

# The setters of ExaoneMoEForCausalLM ask the process's parallel state whether
# this is the last PP rank.
_LAST_PP_RANK = mock.patch.object(
    exaone_moe,
    "get_parallel",
    return_value=types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True)
    ),
)


class _Layer(nn.Module):
    """Completes the previous layer's output, captures it when asked, and adds
    ``layer_id + 1`` for the next boundary. ExaoneMoEModel and BailingMoEModel
    pass ``capture_output`` (BailingMoEModel also the collector itself, as
    ``captured_last_layer_outputs``, to a layer flagged
    ``_is_layer_to_capture``); LongcatFlashModel snapshots between layers itself
    and hands each layer its zero allocator and top-k indices, which it returns.
    """

    def __init__(self, layer_id, returns_topk):
        super().__init__()
        self.layer_id = layer_id
        self.returns_topk = returns_topk

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        *unused,
        capture_output=None,
        captured_last_layer_outputs=None,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        out = residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)
        return (out, None) if self.returns_topk else out


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
    returns_topk = model_cls is LongcatFlashModel
    model.layers = nn.ModuleList([_Layer(i, returns_topk) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.use_ngram_embedding = False
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _causal_lm(lm_cls, model):
    lm = lm_cls.__new__(lm_cls)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    return lm


def _run(model, embeds, buffer=None, forward_mode=None):
    if forward_mode is None:
        forward_mode = ForwardMode.EXTEND if embeds.shape[0] else ForwardMode.IDLE
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=forward_mode,
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


class TestMoeModelsAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        layers_to_capture = [0, 1, 3, NUM_LAYERS]
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
                _, aux = _run(
                    model, embeds.clone(), shared[:TOKENS], ForwardMode.DECODE
                )
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

    def test_bailing_flagged_layer_adds_its_gathered_capture(self):
        model = _model(BailingMoEModel, [1, NUM_LAYERS])
        model.layers[2]._is_layer_to_capture = True
        embeds = torch.randn(TOKENS, HIDDEN)
        _, aux = _run(model, embeds.clone())
        torch.testing.assert_close(aux, _expected(embeds, [1, 2, NUM_LAYERS]))

    def test_pipeline_stage_counts_its_own_captures(self):
        for model_cls in (ExaoneMoEModel, BailingMoEModel):
            with self.subTest(model=model_cls.__name__):
                model = _model(model_cls, [1, 2, 3, NUM_LAYERS])
                model.start_layer, model.end_layer = 2, 3
                # index 2 at the input of layer 2, index 3 at the stage's end
                self.assertEqual(model.num_aux_captures(), 2)

    @_LAST_PP_RANK
    def test_causal_lm_reports_the_packed_width(self, _):
        for model_cls, lm_classes in FAMILY:
            for lm_cls in lm_classes:
                with self.subTest(model=lm_cls.__name__):
                    lm = _causal_lm(lm_cls, _model(model_cls))
                    lm.capture_aux_hidden_states = False
                    self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                    lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                    self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)

    def test_draft_classes_report_no_width(self):
        # Neither draft sets capture_aux_hidden_states; the NextN one also swaps
        # the model for its own.
        drafts = (
            (ExaoneMoEForCausalLMMTP, _model(ExaoneMoEModel)),
            (LongcatFlashForCausalLMNextN, nn.Module()),
        )
        for lm_cls, model in drafts:
            with self.subTest(model=lm_cls.__name__):
                lm = _causal_lm(lm_cls, model)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)


if __name__ == "__main__":
    unittest.main()
