# upstream-path: test/registered/unit/models/test_gemma3_capture_layer_output.py
"""Gemma3TextModel captures each layer's output, not its FFN output.

Gemma3DecoderLayer returns its FFN output and the residual separately; the
next fused-add Gemma3RMSNorm adds them in place. An EAGLE3/DFlash capture
must therefore be ``hidden_states + residual`` (the layer's output) in fresh
storage, which later in-place norms, including the final one, do not change.

Runs on CPU without a GPU or a checkpoint: the decoder layers are small
stand-ins with Gemma3DecoderLayer's residual layout, and the norms update
their inputs in place like the fused GPU kernel; Gemma3TextModel.forward is
the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.models.gemma3_causal import Gemma3TextModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 3


class _InPlaceNorm(nn.Module):
    """gemma_fused_add_rmsnorm: the output overwrites x, x + residual the
    residual, as in Gemma3RMSNorm.forward_cuda."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * 0.5
        residual.add_(x)
        x.copy_(residual * 0.5)
        return x, residual


class _Layer(nn.Module):
    """Gemma3DecoderLayer's residual layout: it adopts its input as the
    residual in the first layer, otherwise adds its input in place with the
    fused input norm, and returns its FFN output and the residual apart.
    Its FFN output is a layer-specific constant."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = _InPlaceNorm()

    def forward(self, positions, hidden_states, forward_batch, residual=None, **kw):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return torch.full_like(hidden_states, float(self.layer_id + 1)), residual


def _model(layers_to_capture):
    model = Gemma3TextModel.__new__(Gemma3TextModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.rotary_emb = model.rotary_emb_local = lambda hidden_states, positions: None
    return model


def _run(model, embeds):
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=types.SimpleNamespace(aux_hidden_states_buffer=None),
        input_embeds=embeds,
    )


def _captures(aux):
    """The captures one by one, from a list or from a packed [T, K * H] tensor."""
    return aux.split(HIDDEN, dim=-1) if isinstance(aux, torch.Tensor) else aux


def _output_of(embeds, layer_id):
    # Layer k's FFN output is k + 1, so its output (FFN output plus residual)
    # is the embedding plus 1 + ... + (k + 1); layer -1 is the embedding.
    return embeds + float(sum(range(1, layer_id + 2)))


class TestGemma3CaptureLayerOutput(CustomTestCase):
    def test_captures_are_layer_outputs(self):
        layers_to_capture = [0, 1, 2, NUM_LAYERS]
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(layers_to_capture), embeds.clone())
        aux = _captures(aux)
        self.assertEqual(len(aux), len(layers_to_capture))
        # capture index i is the output of layer i - 1, taken before the
        # later in-place norms ran
        for capture, layer_id in zip(aux, layers_to_capture):
            with self.subTest(layer_id=layer_id):
                torch.testing.assert_close(capture, _output_of(embeds, layer_id - 1))
        torch.testing.assert_close(hidden, aux[-1] * 0.5)

    def test_final_capture_is_not_the_normed_output(self):
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model([NUM_LAYERS]), embeds.clone())
        (final,) = _captures(aux)
        self.assertNotEqual(final.data_ptr(), hidden.data_ptr())
        torch.testing.assert_close(final, _output_of(embeds, NUM_LAYERS - 1))


if __name__ == "__main__":
    unittest.main()
