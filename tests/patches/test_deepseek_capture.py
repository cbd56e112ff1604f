"""deepseek_v2 captures through the communicator, after prepare_attn (patch
dsv2-capture-after-allreduce), on the real DeepseekV2Model.forward at TP = 1.

At TP = 1 nothing is deferred, so the pin's `hidden_states + residual` has the
right value; what this guards here is the wiring: the capture is taken by
LayerCommunicator.prepare_attn_and_capture_last_layer_outputs inside
DeepseekV2DecoderLayer.forward, for exactly the layers to capture. The value at
TP > 1 with fusion is checked in tests/multirank.
"""

from __future__ import annotations

import unittest.mock as mock

import pytest
import torch

from harness.standins.deepseek_v2 import run_model
from harness.suites.capture import (
    as_packed,
    input_ids,
    layer_sets,
    reference_layer_outputs,
)

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")


@pytest.mark.guards("dsv2-capture-after-allreduce")
@pytest.mark.parametrize("name", ["eagle3-default", "dflash"])
def test_decoder_layers_capture_through_the_communicator(tiny_model, name):
    layers = layer_sets(len(tiny_model.layers))[name]
    calls = {}
    patches = []
    for i, layer in enumerate(tiny_model.layers):
        comm = layer.layer_communicator
        orig = comm.prepare_attn_and_capture_last_layer_outputs

        def spy(*args, _i=i, _orig=orig, **kwargs):
            calls[_i] = kwargs.get("captured_last_layer_outputs")
            return _orig(*args, **kwargs)

        patches.append(mock.patch.object(comm, "prepare_attn_and_capture_last_layer_outputs", spy))
    for p in patches:
        p.start()
    try:
        run_model(tiny_model, input_ids(6), layers)
    finally:
        for p in patches:
            p.stop()
    n = len(tiny_model.layers)
    assert sorted(calls) == list(range(n)), "every decoder layer must go through the capture entry"
    with_collector = sorted(i for i, c in calls.items() if c is not None)
    assert with_collector == sorted(i for i in set(layers) if i < n)
    collectors = {id(calls[i]) for i in with_collector}
    assert len(collectors) == 1, "all captures go to the model's one collector"


@pytest.mark.guards("dsv2-capture-after-allreduce")
def test_decoder_layer_forward_takes_the_collector(tiny_model):
    """The decoder layer appends the post-prepare_attn residual of its input."""
    layer = tiny_model.layers[2]
    h = torch.randint(-3, 4, (5, 16)).to(torch.float64)
    r = torch.randint(-3, 4, (5, 16)).to(torch.float64)
    expected = h + r
    from sglang.srt.utils import BumpAllocator

    from harness.standins.batch import make_forward_batch

    fb = make_forward_batch(torch.arange(5))
    collector = []
    with torch.no_grad():
        layer(
            torch.arange(5),
            h,
            fb,
            r,
            BumpAllocator(buffer_size=4, dtype=torch.float32, device="cpu"),
            captured_last_layer_outputs=collector,
        )
    assert len(collector) == 1
    assert torch.equal(collector[0], expected)


@pytest.mark.parametrize("name", ["eagle3-default", "eagle3-last", "dflash"])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_captures_equal_layer_outputs(tiny_model, name, num_tokens):
    layers = layer_sets(len(tiny_model.layers))[name]
    ids = input_ids(num_tokens)
    refs, ref_final = reference_layer_outputs(tiny_model, ids)
    final, aux = run_model(tiny_model, ids, layers)
    packed = as_packed(aux)
    n = len(tiny_model.layers)
    in_loop = [refs[i] for i in sorted(set(layers)) if i < n]
    assert torch.equal(packed[:, : 16 * len(in_loop)], torch.cat(in_loop, dim=-1))
    assert torch.equal(final, ref_final), "capturing must not change the final hidden states"


@pytest.mark.guards("aux-packer")
@pytest.mark.parametrize("name", ["eagle3-default", "dflash"])
def test_model_hands_over_one_packed_tensor(tiny_model, name):
    """deepseek_v2 collects with the packer: the model returns one [T, K * H] tensor
    (the buffer the captures were written into), not a list for the logits
    processor to concatenate."""
    layers = layer_sets(len(tiny_model.layers))[name]
    _, aux = run_model(tiny_model, input_ids(5), layers)
    assert isinstance(aux, torch.Tensor), f"model returned {type(aux).__name__}, not a packed tensor"
    assert aux.shape == (5, 16 * len(set(layers)))
