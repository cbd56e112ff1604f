# upstream-path: test/registered/unit/models/test_aux_capture_by_index.py
"""Models capture the layers in ``layers_to_capture``, however it was set.

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
(``forward_batch.residual_stream``); each model's forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.models.qwen2_moe import Qwen2MoeModel
from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeModel
from sglang.srt.models.qwen3_next import Qwen3NextModel
from sglang.test.aux_capture_test_utils import StreamLayer, forward_batch, stream_after
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4

# The models whose forward decided the in-loop captures by a per-layer flag.
MODEL_CLASSES = (
    Qwen2MoeModel,
    Qwen3MoeModel,
    Qwen3NextModel,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
)


class _Norm(nn.Module):
    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states * 0.5
        residual = hidden_states + residual
        return residual * 0.5, residual


def _model(model_cls):
    """The model without its __init__: stand-in layers and norm, no captures
    requested, and the attributes its forward reads for one pipeline rank."""
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([StreamLayer(i) for i in range(NUM_LAYERS)])
    model.norm = _Norm()
    model.layers_to_capture = []
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    if issubclass(model_cls, Qwen2MoeModel):
        model.start_layer, model.end_layer = 0, NUM_LAYERS
    if issubclass(model_cls, Qwen3_5ForCausalLM):
        # start_layer and end_layer are properties over these
        model._start_layer, model._end_layer = 0, NUM_LAYERS
        model.hidden_size = HIDDEN
        model.flashinfer_mnnvl_cutedsl_fusion = None
    return model


def _run(model, embeds):
    # The fourth argument is the input embeddings (input_embeds or
    # inputs_embeds, depending on the model).
    out = model.forward(None, torch.arange(embeds.shape[0]), forward_batch(), embeds)
    # A model returns the captures only when it took some.
    if not isinstance(out, tuple):
        return out, []
    hidden, aux = out
    # A model that packs its captures (AuxHiddenStatePacker) returns one
    # [tokens, K * hidden] tensor: one capture per HIDDEN columns.
    if isinstance(aux, torch.Tensor):
        aux = list(aux.split(HIDDEN, dim=-1))
    return hidden, aux


_output_of = stream_after


class TestModelsCaptureByIndex(CustomTestCase):
    def _check_captures(self, model, layers_to_capture):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(model, embeds.clone())
        self.assertEqual(
            len(aux),
            len(layers_to_capture),
            f"{len(aux)} of {len(layers_to_capture)} requested captures came out",
        )
        # capture index i is the output of layer i - 1
        for capture, layer_id in zip(aux, layers_to_capture):
            torch.testing.assert_close(capture, _output_of(embeds, layer_id - 1))
        torch.testing.assert_close(hidden, _output_of(embeds, NUM_LAYERS - 1) * 0.5)

    def test_list_set_without_setter(self):
        # The list alone, as a wrapper sets it on its language model; with and
        # without the final layer (taken after the loop).
        for layers_to_capture in ([1, 2, 3], [1, NUM_LAYERS]):
            for model_cls in MODEL_CLASSES:
                with self.subTest(model=model_cls.__name__, ids=layers_to_capture):
                    model = _model(model_cls)
                    model.layers_to_capture = list(layers_to_capture)
                    self._check_captures(model, layers_to_capture)

    def test_list_changed_after_setter(self):
        # The list replaced after a setter ran is what the forward captures.
        for model_cls in MODEL_CLASSES:
            with self.subTest(model=model_cls.__name__):
                model = _model(model_cls)
                if hasattr(model, "set_eagle3_layers_to_capture"):
                    model.set_eagle3_layers_to_capture([1, 2, 3])
                else:
                    model.set_dflash_layers_to_capture([1, 2, 3])
                model.layers_to_capture = [2]
                self._check_captures(model, [2])

    def test_setters_request_the_same_captures(self):
        layers_to_capture = [1, 3, NUM_LAYERS]
        for model_cls in MODEL_CLASSES:
            for setter in (
                "set_eagle3_layers_to_capture",
                "set_dflash_layers_to_capture",
            ):
                if not hasattr(model_cls, setter):
                    continue
                with self.subTest(model=model_cls.__name__, setter=setter):
                    model = _model(model_cls)
                    getattr(model, setter)(layers_to_capture)
                    self._check_captures(model, layers_to_capture)


if __name__ == "__main__":
    unittest.main()
