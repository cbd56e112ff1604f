# upstream-path: test/registered/unit/models/test_beam_aux_packer.py
"""BeamModel packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). BeamModel (capture ids are
layer outputs, each taken after its layer inside the layer loop, the last
layer's included) collects into AuxHiddenStatePacker instead, in both of its
loops: the plain one (``layer(...)``, used under CPU offload) and the fused one
(``layer.forward_fused``, whose norm/residual transitions also produce the next
layer's input norm or the final norm). Each capture is copied once into its
slot of one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
BeamForCausalLM.get_aux_hidden_states_width.

Runs on CPU without a GPU or a checkpoint: the decoder layers (their sandwich
norms, depth-scaled residuals and fused transitions) and BeamModel.forward are
the real ones; the attention and MLP are small stand-ins. On the CPU the fused
loop's all-reduce replacements are off (they need CUDA tensors).
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.configs.beam import BeamConfig
from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.models import beam
from sglang.srt.models.beam import BeamDecoderLayer, BeamForCausalLM, BeamModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
# The plain loop (fuse_layers off, as under CPU offload) and the fused loop.
LOOPS = (("plain", False), ("fused", True))


class _Attention(nn.Module):
    """Stands in for BeamAttention: a fixed per-layer linear map of the normed input."""

    def __init__(self, config, layer_id, quant_config=None, prefix="", rotary_emb=None):
        super().__init__()
        g = torch.Generator().manual_seed(100 + layer_id)
        self.weight = torch.randn(config.hidden_size, config.hidden_size, generator=g)

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        ssmax_scale,
        *,
        skip_all_reduce=False,
    ):
        return hidden_states @ self.weight


class _MLP(nn.Module):
    """Stands in for BeamMLP: ``tanh`` of a fixed per-layer linear map."""

    def __init__(self, config, prefix="", quant_config=None):
        super().__init__()
        g = torch.Generator().manual_seed(200 + int(prefix.split(".")[1]))
        self.weight = torch.randn(config.hidden_size, config.hidden_size, generator=g)

    def forward(self, x, skip_all_reduce=False):
        return torch.tanh(x @ self.weight)


def _config():
    return BeamConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=4,
        mlp_layer_types=["dense"] * NUM_LAYERS,
    )


def _layers(config):
    """The real BeamDecoderLayers, with the attention and MLP stood in."""
    parallel = types.SimpleNamespace(attn_dp_size=1)
    with (
        mock.patch.object(beam, "BeamAttention", _Attention),
        mock.patch.object(beam, "BeamMLP", _MLP),
        mock.patch.object(beam, "get_parallel", lambda: parallel),
    ):
        layers = nn.ModuleList(
            BeamDecoderLayer(config, i, prefix=f"layers.{i}") for i in range(NUM_LAYERS)
        )
    g = torch.Generator().manual_seed(7)
    for module in layers.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    return layers


def _model(fused, layer_ids=(), start_layer=0, end_layer=NUM_LAYERS):
    config = _config()
    model = BeamModel.__new__(BeamModel)
    nn.Module.__init__(model)
    model.config = config
    model.layers = _layers(config)
    model.start_layer, model.end_layer = start_layer, end_layer
    model.norm = RMSNorm(HIDDEN, eps=config.rms_norm_eps)
    model.norm.weight.data = torch.linspace(0.5, 1.5, HIDDEN)
    model.pp_group = types.SimpleNamespace(
        is_first_rank=start_layer == 0,
        is_last_rank=end_layer == NUM_LAYERS,
        world_size=1,
    )
    model.has_full_attention = True
    model.layers_to_capture = tuple(layer_ids)
    model.fuse_moe_all_reduce = False
    model._beam_all_reduce_comm = None
    model.fuse_layers = fused
    model._flashinfer_ar_tokens = None
    model._flashinfer_ar = None
    model._mlp_has_single_tp_sum = True
    return model


def _batch(buffer=None):
    return types.SimpleNamespace(aux_hidden_states_buffer=buffer)


def _run(model, embeds, buffer=None):
    with torch.no_grad():
        return model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=_batch(buffer),
            input_embeds=embeds,
        )


def _layer_outputs(model, embeds):
    """Each layer's output, by the layers' own unfused forward (not the model's)."""
    positions = torch.arange(embeds.shape[0])
    scale = beam.compute_ssmax_scale(positions)
    outputs, hidden = [], embeds
    with torch.no_grad():
        for layer in model.layers:
            hidden = layer(positions, hidden, _batch(), scale)
            outputs.append(hidden)
    return outputs


class TestBeamAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's output, taken inside the loop.
        layer_ids = (0, 2, NUM_LAYERS - 1)
        embeds = torch.randn(TOKENS, HIDDEN)
        for loop, fused in LOOPS:
            with self.subTest(loop=loop):
                model = _model(fused, layer_ids)
                hidden, aux = _run(model, embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
                outputs = _layer_outputs(model, embeds)
                torch.testing.assert_close(
                    aux, torch.cat([outputs[i] for i in layer_ids], dim=-1)
                )
                # The final norm's output, not the capture (post_norm is refused).
                torch.testing.assert_close(hidden, model.norm(outputs[-1]))
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = (1, NUM_LAYERS - 1)
        embeds = torch.randn(TOKENS, HIDDEN)
        for loop, fused in LOOPS:
            with self.subTest(loop=loop):
                model = _model(fused, layer_ids)
                _, packed = _run(model, embeds.clone())
                shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
                _, aux = _run(model, embeds.clone(), shared[:TOKENS])
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                torch.testing.assert_close(shared[:TOKENS], packed)
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        for loop, fused in LOOPS:
            with self.subTest(loop=loop):
                out = _run(_model(fused), torch.randn(TOKENS, HIDDEN))
                self.assertIsInstance(out, torch.Tensor)

    def test_pipeline_stage_counts_its_own_layers(self):
        # A stage packs the listed outputs of its own layers only.
        model = _model(True, (0, 2, NUM_LAYERS - 1), start_layer=1, end_layer=3)
        self.assertEqual(model.num_aux_captures(), 1)
        self.assertEqual(_model(False, (0, 1)).num_aux_captures(), 2)

    def test_causal_lm_reports_the_packed_width(self):
        lm = BeamForCausalLM.__new__(BeamForCausalLM)
        nn.Module.__init__(lm)
        lm.model = _model(True)
        lm.config = lm.model.config
        lm.capture_aux_hidden_states = False
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)
        _, aux = _run(lm.model, torch.randn(TOKENS, HIDDEN))
        self.assertEqual(aux.shape[-1], lm.get_aux_hidden_states_width())


if __name__ == "__main__":
    unittest.main()
