# upstream-path: test/registered/spec/test_deepseek_v2_capture_final_layer.py
"""DeepseekV2Model captures the final layer's output when it is requested.

EAGLE3/DFlash capture index i is the input of layer i, so index ``end_layer``
(the output of the last layer) is never reached inside the layer loop. The
model must capture it after the loop and before the final norm, with the same
value an in-loop capture of a following layer would have taken.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are replaced by small stand-ins; DeepseekV2Model.forward is the real one.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.models import deepseek_v2
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5


class _Layer(nn.Module):
    """Adds a layer-specific constant; captures its input like the communicator."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self, positions, hidden_states, forward_batch, residual, *args, **kwargs
    ):
        captured = kwargs.get("captured_last_layer_outputs")
        if residual is None:
            residual = hidden_states
        else:
            residual = hidden_states + residual
        if captured is not None:
            captured.append(residual.clone())
        hidden_states = torch.full_like(residual, float(self.layer_id + 1))
        return hidden_states, residual, None


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None):
        if residual is None:
            hidden_states.mul_(0.5)
            return hidden_states
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
    model.first_k_dense_replace = 0
    model.dsa_enable_prefill_cp = False
    model.mla_enable_prefill_cp = False
    model.llama_4_scaling_config = None
    model.enable_a2a_moe = False
    return model


def _forward_batch():
    return types.SimpleNamespace(
        can_run_tbo=False,
        attn_cp_metadata=None,
        forward_mode=types.SimpleNamespace(is_idle=lambda: False),
    )


def _run(model, embeds):
    server_args = types.SimpleNamespace(disable_piecewise_cuda_graph=False)
    with mock.patch.object(
        deepseek_v2, "get_global_server_args", return_value=server_args
    ):
        return model.forward(
            input_ids=None,
            positions=torch.arange(TOKENS),
            forward_batch=_forward_batch(),
            input_embeds=embeds,
        )


def _as_list(aux):
    if isinstance(aux, torch.Tensor):
        return list(aux.split(HIDDEN, dim=-1))
    return list(aux)


class TestDeepseekV2CaptureFinalLayer(unittest.TestCase):
    def test_final_layer_is_captured(self):
        num_layers = 3
        embeds = torch.randn(TOKENS, HIDDEN)
        _, aux = _run(_model(num_layers, [1, num_layers]), embeds.clone())
        aux = _as_list(aux)
        self.assertEqual(len(aux), 2, "expected one capture per requested layer")

        # Reference: layer k outputs hidden_states + residual = embeds + sum(1..k+1);
        # capture index i is the output of layer i - 1.
        def output_of(k):
            return embeds + float(sum(range(1, k + 2)))

        torch.testing.assert_close(aux[0], output_of(0))
        torch.testing.assert_close(aux[1], output_of(num_layers - 1))

    def test_final_capture_is_not_changed_by_the_in_place_norm(self):
        num_layers = 2
        embeds = torch.randn(TOKENS, HIDDEN)
        hidden, aux = _run(_model(num_layers, [num_layers]), embeds.clone())
        (final,) = _as_list(aux)
        # the norm halves the residual stream in place; the capture must not move
        torch.testing.assert_close(final * 0.5, hidden)

    def test_no_final_capture_when_not_requested(self):
        num_layers = 3
        _, aux = _run(_model(num_layers, [1, 2]), torch.randn(TOKENS, HIDDEN))
        self.assertEqual(len(_as_list(aux)), 2)


if __name__ == "__main__":
    unittest.main()
