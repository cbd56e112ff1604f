# upstream-path: test/registered/unit/models/test_deepseek_mimo_aux_buffer.py
"""DeepseekV2Model and MiMoV2Model pack into a DFlash decode graph's buffer.

A DFlash decode graph sizes one shared aux hidden state buffer from
``get_aux_hidden_states_width()`` and hands each batch a slice of it
(``forward_batch.aux_hidden_states_buffer``); a model whose packer takes that
slice writes its captures there instead of pinning an output of its own per
graph size. DeepseekV2Model and MiMoV2Model sized their packer with
``len(layers_to_capture)`` and ignored the slice, and their CausalLMs (and
Kimi-K2.5's wrapper) reported no width.

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins on the real residual stream; the models' forwards, the setters the
model runner calls and its width resolution are the real ones.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components.misc_utils import (
    resolve_aux_hidden_states_width,
)
from sglang.srt.models import deepseek_v2, kimi_k25, mimo_v2
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
# Draft ids (layer outputs) 0, 1, 2: capture indices 1, 2, 3, in the layer loop.
DRAFT_IDS = [0, 1, 2]
DFLASH = types.SimpleNamespace(is_dflash_family=lambda: True)


class _Layer(nn.Module):
    """Completes the previous layer's output on the residual stream, captures it
    when asked, and adds a layer-specific constant (its own contribution)."""

    def __init__(self, layer_id, returns_topk):
        super().__init__()
        self.layer_id = layer_id
        self.returns_topk = returns_topk

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        *args,
        captured_last_layer_outputs=None,
        **kwargs,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        out = residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)
        return (out, None) if self.returns_topk else out


class _Norm(nn.Module):
    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states * 0.5
        residual = residual + hidden_states
        return residual * 0.5, residual


def _deepseek_model():
    model = deepseek_v2.DeepseekV2Model.__new__(deepseek_v2.DeepseekV2Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i, True) for i in range(NUM_LAYERS)])
    model.use_dsa = False
    model.first_k_dense_replace = 0
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    return model


def _mimo_model():
    model = mimo_v2.MiMoV2Model.__new__(mimo_v2.MiMoV2Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i, False) for i in range(NUM_LAYERS)])
    return model


def _causal_lm(name):
    """The CausalLM the model runner holds, over its real model class."""
    cls, model = {
        "deepseek_v2": (deepseek_v2.DeepseekV2ForCausalLM, _deepseek_model),
        "mimo_v2": (mimo_v2.MiMoV2ForCausalLM, _mimo_model),
    }[name]
    model = model()
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = []
    model.norm = _Norm()
    model.config = types.SimpleNamespace(
        num_hidden_layers=NUM_LAYERS, hidden_size=HIDDEN
    )
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = model.config
    lm.pp_group = model.pp_group
    lm.capture_aux_hidden_states = False
    return lm


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        return_hidden_states_before_norm=False,
        aux_hidden_states_buffer=buffer,
    )
    out = model.forward(
        None, torch.arange(embeds.shape[0]), forward_batch, input_embeds=embeds
    )
    return out[-1]


class TestDeepseekMiMoAuxBuffer(CustomTestCase):
    def test_width_is_reported_after_the_dflash_setter(self):
        for name in ("deepseek_v2", "mimo_v2"):
            with self.subTest(model=name):
                lm = _causal_lm(name)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture(DRAFT_IDS)
                want = len(DRAFT_IDS) * HIDDEN
                self.assertEqual(lm.get_aux_hidden_states_width(), want)
                for draft_worker, width in ((False, want), (True, 0)):
                    self.assertEqual(
                        resolve_aux_hidden_states_width(
                            model=lm,
                            spec_algorithm=DFLASH,
                            is_draft_worker=draft_worker,
                        ),
                        width,
                    )

    def test_kimi_k25_reports_its_language_model_width(self):
        wrapper = kimi_k25.KimiK25ForConditionalGeneration.__new__(
            kimi_k25.KimiK25ForConditionalGeneration
        )
        nn.Module.__init__(wrapper)
        wrapper.language_model = _causal_lm("deepseek_v2")
        wrapper.set_dflash_layers_to_capture(DRAFT_IDS)
        self.assertEqual(
            resolve_aux_hidden_states_width(
                model=wrapper, spec_algorithm=DFLASH, is_draft_worker=False
            ),
            len(DRAFT_IDS) * HIDDEN,
        )

    def test_decode_graph_buffer_is_filled_in_place(self):
        for name in ("deepseek_v2", "mimo_v2"):
            with self.subTest(model=name):
                lm = _causal_lm(name)
                lm.set_dflash_layers_to_capture(DRAFT_IDS)
                embeds = torch.randn(TOKENS, HIDDEN)
                packed = _run(lm.model, embeds.clone())
                width = lm.get_aux_hidden_states_width()
                self.assertEqual(tuple(packed.shape), (TOKENS, width))
                # Capture index i is the output of layer i - 1: the embedding plus
                # 1 + ... + i.
                for slot, index in enumerate(i + 1 for i in DRAFT_IDS):
                    torch.testing.assert_close(
                        packed[:, slot * HIDDEN : (slot + 1) * HIDDEN],
                        embeds + float(sum(range(1, index + 1))),
                    )
                shared = torch.full((TOKENS + 3, width), float("nan"))
                aux = _run(lm.model, embeds.clone(), buffer=shared[:TOKENS])
                self.assertEqual(aux.data_ptr(), shared.data_ptr())
                torch.testing.assert_close(shared[:TOKENS], packed)
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())


if __name__ == "__main__":
    unittest.main()
