"""Exact peak bytes of MuseSpark1xModel's capture path on 0.5.23 (muse-spark-aux-packer),
and the packed buffer's width and decode-graph reuse.

Muse Spark has no stand-in spec (its fused norm boundaries, the fp32 residual stream
under a narrower operator dtype and its DFlash-only setter do not fit the generic
suites' float32/float64 models: at operator dtype == residual dtype the pristine
``stream.to(operator_dtype)`` is the stream itself). So this module builds the real
``MuseSpark1xModel`` twice, from the pristine 0.5.23 file (read from the verified
release wheel) and from the patched one, with whole-layer stand-ins on its real
forward at the real dtypes (an fp32 residual stream, bf16 operator dtype), and
measures what ``harness.memory.models._peak`` measures: the storage of the captures
the forward returns plus what ``pack_aux_hidden_states`` adds. Pristine: K captures
(each a new ``stream.to(bf16)``) and their concatenation, 2 x K*T*H*2 bytes; patched:
one packed bf16 buffer, 1 x.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.bases("0.5.23")

HIDDEN = 16
NUM_LAYERS = 6
LAYER_IDS = [1, 3, NUM_LAYERS - 1]  # layer-output ids, the last layer's included


def _model(module, layer_ids):
    import torch
    from torch import nn

    class Layer(nn.Module):
        """MuseSpark1xDecoderLayer's interface: the fp32 stream updated in place, the
        next attention input in operator dtype (None after the last layer)."""

        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id

        def self_attn_input_norm(self, stream):
            return stream.to(torch.bfloat16)

        def forward(self, positions, stream, attn_input, forward_batch):
            stream.add_(float(self.layer_id + 1))
            last = self.layer_id == NUM_LAYERS - 1
            return stream, None if last else self.self_attn_input_norm(stream)

    class Norm(nn.Module):
        def forward(self, hidden_states):
            return hidden_states * 0.5

    cls = module.MuseSpark1xModel
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.operator_dtype = torch.bfloat16
    model.residual_dtype = torch.float32
    model.embed_norm = None
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    model.norm = Norm()
    model.layers_to_capture = list(layer_ids)
    return model


def _forward(model, embeds, buffer=None):
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    forward_batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND,
                                          aux_hidden_states_buffer=buffer)
    with torch.no_grad():
        return model.forward(input_ids=None, positions=torch.arange(embeds.shape[0]),
                             forward_batch=forward_batch, input_embeds=embeds)


def _capture_path_bytes(model, embeds):
    """The captures' storage the forward returns plus the peak of packing them."""
    from harness.memory.models import capture_path_bytes

    _, aux = _forward(model, embeds.clone())
    return capture_path_bytes(aux)


def _expected(embeds, layer_ids):
    import torch

    stream = embeds.float()
    return torch.cat([(stream + float(sum(range(1, i + 2)))).to(torch.bfloat16)
                      for i in layer_ids], dim=-1)


@pytest.mark.guards("muse-spark-aux-packer")
@pytest.mark.parametrize("tokens", [1, 96])
def test_goes_from_twice_to_once_the_captures(sglang_tp1, tokens):
    import torch

    from harness.memory.models import pin_module
    from sglang.srt.models import muse_spark

    embeds = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    s = len(LAYER_IDS) * tokens * HIDDEN * torch.bfloat16.itemsize
    pristine = _capture_path_bytes(_model(pin_module("muse_spark"), LAYER_IDS), embeds)
    patched = _capture_path_bytes(_model(muse_spark, LAYER_IDS), embeds)
    assert (pristine, patched) == (2 * s, s), (pristine, patched, s)


@pytest.mark.guards("muse-spark-aux-packer")
def test_decode_graph_buffer_is_filled_in_place(sglang_tp1):
    """A DFlash decode graph hands every batch a slice of one shared buffer, in the
    model's dtype (bf16, the operator dtype): the packed result is that storage."""
    import torch

    from sglang.srt.models import muse_spark

    tokens = 5
    embeds = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    width = len(LAYER_IDS) * HIDDEN
    shared = torch.full((tokens + 5, width), float("nan"), dtype=torch.bfloat16)
    _, aux = _forward(_model(muse_spark, LAYER_IDS), embeds.clone(), shared[:tokens])
    assert aux.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    assert torch.equal(shared[:tokens], _expected(embeds, LAYER_IDS))
    assert torch.isnan(shared[tokens:]).all(), "wrote past the batch's slice"


@pytest.mark.guards("muse-spark-aux-packer")
def test_causal_lm_reports_the_packed_width(sglang_tp1):
    """What ``ModelRunner.get_aux_hidden_states_width`` reads to size that buffer: the
    real setter, then the real method; 0 until capture is configured."""
    from torch import nn

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )
    from sglang.srt.models import muse_spark

    lm = muse_spark.MuseSparkTextForCausalLM.__new__(muse_spark.MuseSparkTextForCausalLM)
    nn.Module.__init__(lm)
    lm.model = muse_spark.MuseSparkModel.__new__(muse_spark.MuseSparkModel)
    nn.Module.__init__(lm.model)
    lm.model.language_model = _model(muse_spark, [])
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm.capture_aux_hidden_states = False
    assert lm.get_aux_hidden_states_width() == 0
    lm.set_dflash_layers_to_capture(LAYER_IDS)
    want = len(LAYER_IDS) * HIDDEN
    assert lm.get_aux_hidden_states_width() == want
    dflash = types.SimpleNamespace(is_dflash_family=lambda: True)
    assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                           is_draft_worker=False) == want
    assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                           is_draft_worker=True) == 0
