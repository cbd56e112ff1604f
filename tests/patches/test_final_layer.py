"""The final layer's output is captured (patch dsv2-capture-final-layer), on the
real DeepseekV2Model.forward at TP = 1."""

from __future__ import annotations

import unittest.mock as mock

import pytest
import torch

from harness.standins.deepseek_v2 import run_model
from harness.suites.capture import (
    as_packed,
    collector,
    input_ids,
    layer_sets,
    num_captured,
    reference_layer_outputs,
)

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

GUARD = pytest.mark.guards("dsv2-capture-final-layer")


@GUARD
@pytest.mark.parametrize("name", ["eagle3-last", "dflash"])
@pytest.mark.parametrize("kind", ["packer", "list"])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_k_of_k_including_the_last_layer(tiny_model, name, kind, num_tokens):
    n = len(tiny_model.layers)
    layers = layer_sets(n)[name]
    assert n in layers
    ids = input_ids(num_tokens)
    refs, ref_final = reference_layer_outputs(tiny_model, ids)
    with collector(kind):
        final, aux = run_model(tiny_model, ids, layers)
    got = num_captured(aux, 16)
    assert got == len(set(layers)), f"captured {got} of {len(set(layers))} aux hidden states"
    expected = torch.cat([refs[i] for i in sorted(set(layers))], dim=-1)
    assert torch.equal(as_packed(aux), expected)
    # the last block is the last layer's output before the final norm
    assert torch.equal(as_packed(aux)[:, -16:], refs[n])
    assert torch.equal(final, ref_final), "capturing must not change the final hidden states"


@GUARD
def test_final_capture_survives_the_in_place_final_norm(tiny_model):
    """The final norm updates hidden_states/residual in place (CUDA fused_add_rmsnorm
    semantics, kept by the CPU kernel). The capture must not alias them."""
    n = len(tiny_model.layers)
    ids = input_ids(4)
    refs, _ = reference_layer_outputs(tiny_model, ids)
    norm_inputs = []
    orig = tiny_model.norm._forward_method

    def spy(x, residual=None, *a):
        norm_inputs.append((x, residual))
        return orig(x, residual, *a)

    with mock.patch.object(tiny_model.norm, "_forward_method", spy):
        _, aux = run_model(tiny_model, ids, [n])
    packed = as_packed(aux)
    assert packed.shape == (4, 16)
    assert torch.equal(packed, refs[n])
    for t in norm_inputs[0]:
        if t is not None:
            assert packed.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@GUARD
def test_idle_batch_captures_zero_tokens(tiny_model):
    n = len(tiny_model.layers)
    final, aux = run_model(tiny_model, input_ids(0), [2, n], mode="idle")
    assert as_packed(aux).shape == (0, 32)


def test_non_last_pipeline_stage_does_not_capture_the_end_layer(tiny_model):
    """With pipeline parallelism only the last stage captures its end layer: an
    earlier stage hands hidden_states/residual on (the next stage captures them at its
    first layer), and must not try to append a final capture nor finalize."""
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    n = len(tiny_model.layers)
    ids = input_ids(3)
    refs, _ = reference_layer_outputs(tiny_model, ids)
    pp = mock.MagicMock(is_last_rank=False, is_first_rank=True)
    with mock.patch.object(tiny_model, "pp_group", pp):
        out = run_model(tiny_model, ids, [2, n])[0]
    assert isinstance(out, PPProxyTensors)
    handed_on = out["hidden_states"] + out["residual"]
    assert torch.equal(handed_on, refs[n]), "the stage hands the last layer's output on"
