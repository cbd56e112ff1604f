# upstream-path: test/registered/unit/models/test_beam_post_norm_capture.py
"""BeamModel serves a post_norm capture of its last layer.

A draft whose config asks for ``final_layer_capture: post_norm`` wants the last
layer's capture to be the final norm's output (transformers'
``hidden_states[num_layers]``). BeamModel takes that capture inside its layer
loops, before the final norm, and the model runner refused post_norm for it.
Both loops can take it after the norm instead: the plain loop normalises after
the loop, and the fused loop's last transition already produces the final
norm's output. With post_norm the last slot holds that output (and the other
slots, and the hidden states returned, are what pre_norm gives); the model
runner configures it.

Runs on CPU without a GPU or a checkpoint: the decoder layers (their norms and
fused transitions) and BeamModel.forward are the real ones; the attention and
MLP are small stand-ins; the final norm's weight is not 1.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.configs.beam import BeamConfig
from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_executor.model_runner_components import attention_backend_setup
from sglang.srt.models import beam
from sglang.srt.runtime_context import get_context
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
LAYERS = 4
LAYER_IDS = (1, LAYERS - 1)  # layer outputs; the last one's capture is the question


class _Linear(nn.Module):
    """Stands in for BeamAttention and BeamMLP: a fixed per-instance linear map."""

    seed = 0

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        _Linear.seed += 1
        g = torch.Generator().manual_seed(_Linear.seed)
        self.weight = (
            torch.randn(config.hidden_size, config.hidden_size, generator=g) / 3
        )

    def forward(self, *args, **kwargs):
        hidden = args[1] if len(args) > 1 else args[0]
        return torch.tanh(hidden @ self.weight)


def _model(fused):
    config = BeamConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=4,
        mlp_layer_types=["dense"] * LAYERS,
    )
    with (
        mock.patch.object(beam, "BeamAttention", _Linear),
        mock.patch.object(beam, "BeamMLP", _Linear),
        mock.patch.object(
            beam, "get_parallel", lambda: types.SimpleNamespace(attn_dp_size=1)
        ),
    ):
        layers = nn.ModuleList(
            beam.BeamDecoderLayer(config, i, prefix=f"layers.{i}")
            for i in range(LAYERS)
        )
    model = beam.BeamModel.__new__(beam.BeamModel)
    nn.Module.__init__(model)
    model.config, model.layers = config, layers
    model.start_layer, model.end_layer = 0, LAYERS
    model.norm = RMSNorm(HIDDEN, eps=config.rms_norm_eps)
    model.norm.weight.data = torch.linspace(0.5, 1.5, HIDDEN)
    model.pp_group = types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True, world_size=1
    )
    model.has_full_attention = True
    model.layers_to_capture = LAYER_IDS
    model.fuse_moe_all_reduce = False
    model._beam_all_reduce_comm = None
    model.fuse_layers = fused
    model._flashinfer_ar_tokens = None
    model._flashinfer_ar = None
    model._mlp_has_single_tp_sum = True
    return model


def _run(model, embeds, value):
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
        embeds = torch.randn(TOKENS, HIDDEN)
        for loop, fused in (("plain", False), ("fused", True)):
            with self.subTest(loop=loop):
                model = _model(fused)
                hidden_pre, aux_pre = _run(model, embeds.clone(), "pre_norm")
                hidden, aux = _run(model, embeds.clone(), "post_norm")
                torch.testing.assert_close(hidden, hidden_pre)
                torch.testing.assert_close(aux[:, :HIDDEN], aux_pre[:, :HIDDEN])
                last_pre_norm = aux_pre[:, HIDDEN:]
                torch.testing.assert_close(aux[:, HIDDEN:], model.norm(last_pre_norm))
                torch.testing.assert_close(aux[:, HIDDEN:], hidden)

    def test_model_runner_configures_post_norm(self):
        # The model runner configures the captures once the server args are
        # published.
        server_args = get_context().override_server_args()
        server_args.install()
        self.addCleanup(server_args.restore)
        model = beam.BeamForCausalLM.__new__(beam.BeamForCausalLM)
        nn.Module.__init__(model)
        model.model = _model(fused=True)
        model.model.layers_to_capture = ()
        model.config = model.model.config
        model.capture_aux_hidden_states = False
        attention_backend_setup.configure_aux_hidden_state_capture(
            model=model,
            eagle_use_aux_hidden_state=False,
            eagle_aux_hidden_state_layer_ids=None,
            dflash_use_aux_hidden_state=True,
            dflash_target_layer_ids=list(LAYER_IDS),
            is_dspark=False,
            final_layer_capture="post_norm",
        )
        self.assertEqual(tuple(model.model.layers_to_capture), LAYER_IDS)
        self.assertTrue(aux_hidden_states.final_layer_capture_post_norm(model.model))


if __name__ == "__main__":
    unittest.main()
