# upstream-path: test/registered/unit/models/test_deepseek_v2_capture_final_layer.py
"""DeepseekV2Model captures the final layer's output when it is requested.

EAGLE3/DFlash capture index i is the input of layer i, so index ``end_layer``
(the output of the last layer) is never reached inside the layer loop. The
model must capture it at the final norm, whose fused add + norm updates the
residual in place: the capture is that updated residual (the last layer's
output), not the norm's output; and on an idle batch (which skips the final
norm) too.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); DeepseekV2Model.forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import deepseek_v2
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5


class _Layer(nn.Module):
    """Adds a layer-specific constant to the residual stream.

    Like a decoder layer's attention boundary, it completes the previous
    layer's output (its contribution plus the residual), captures that when
    asked, and records its own contribution for the next boundary.
    """

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

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
        stream = residual_batch.stream_of(forward_batch)
        return stream.record(contribution, PLAIN_ADD), None


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(num_layers, layers_to_capture):
    model = deepseek_v2.DeepseekV2Model.__new__(deepseek_v2.DeepseekV2Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(num_layers)])
    model.start_layer, model.end_layer = 0, num_layers
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.use_dsa = False
    model.first_k_dense_replace = 0
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    return model


def _forward_batch(idle=False):
    return types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.IDLE if idle else ForwardMode.EXTEND,
        aux_hidden_states_buffer=None,  # no decode graph's buffer
    )


def _run(model, embeds, idle=False):
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=_forward_batch(idle),
        input_embeds=embeds,
    )


def _output_of(embeds, layer_id):
    # Layer k adds k + 1, so its output is the embedding plus 1 + ... + (k + 1).
    return embeds + float(sum(range(1, layer_id + 2)))


class TestDeepseekV2CaptureFinalLayer(CustomTestCase):
    def test_final_layer_is_captured(self):
        num_layers = 3
        embeds = torch.randn(TOKENS, HIDDEN)
        _, aux = _run(_model(num_layers, [1, 2, num_layers]), embeds.clone())
        aux = aux.split(HIDDEN, dim=-1)
        self.assertEqual(len(aux), 3, "expected one capture per requested layer")
        # capture index i is the output of layer i - 1
        torch.testing.assert_close(aux[0], _output_of(embeds, 0))
        torch.testing.assert_close(aux[1], _output_of(embeds, 1))
        torch.testing.assert_close(aux[2], _output_of(embeds, num_layers - 1))

    def test_final_capture_is_the_updated_residual_not_the_norm_output(self):
        num_layers = 2
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(num_layers, [1, num_layers]), embeds.clone())
        final = aux.split(HIDDEN, dim=-1)[-1]
        torch.testing.assert_close(final, _output_of(embeds, num_layers - 1))
        # the fused norm adds the last output into the residual in place and
        # halves it for its output; the capture is the updated residual
        torch.testing.assert_close(hidden, final * 0.5)

    def test_idle_batch_captures_final_layer(self):
        num_layers = 3
        embeds = torch.empty(0, HIDDEN)
        _, aux = _run(_model(num_layers, [1, num_layers]), embeds, idle=True)
        self.assertEqual(tuple(aux.shape), (0, 2 * HIDDEN))

    def test_no_final_capture_when_not_requested(self):
        num_layers = 3
        embeds = torch.randn(TOKENS, HIDDEN)
        _, aux = _run(_model(num_layers, [1, 2]), embeds.clone())
        self.assertEqual(tuple(aux.shape), (TOKENS, 2 * HIDDEN))


if __name__ == "__main__":
    unittest.main()
