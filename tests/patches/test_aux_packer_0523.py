"""LlamaModel's packed aux hidden states on 0.5.23 (patch llama-aux-packer): the
forward returns one [T, K * H] buffer, fills a DFlash decode graph's shared buffer when
the batch carries one, and its CausalLM reports that buffer's width to the model runner.

A tiny real ``LlamaModel`` (CPU stand-ins for attention and MLP only, as in the model
matrix). That the packed captures equal the layers' complete outputs is checked for
every model in ``tests/patches/test_model_forward.py`` (``test_returns_packed_captures``,
llama guarded by this patch); here the run without a graph buffer is the reference.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

pytestmark = [pytest.mark.bases("0.5.23"), pytest.mark.guards("llama-aux-packer")]

TOKENS = 7
LAYERS = [2, 4, 8]  # 8 = end_layer of the 8-layer tiny model: the final norm's capture


@pytest.fixture(scope="module")
def llama(sglang_tp1):
    from harness.standins.models import build, specs

    spec = specs()["llama"]
    tiny = dataclasses.replace(spec.tiny, dtype="float32")
    spec = dataclasses.replace(spec, tiny=tiny)
    return spec, build(spec, tiny)


def _run(spec, model, layers, buffer=None):
    import torch

    from harness.standins.batch import make_forward_batch

    ids = torch.randint(1, spec.tiny.vocab_size, (TOKENS,),
                        generator=torch.Generator().manual_seed(3))
    spec.configure(model, layers)
    fb = make_forward_batch(ids)
    fb.aux_hidden_states_buffer = buffer
    try:
        with torch.no_grad():
            out = spec.run(model, fb.input_ids, fb.positions, fb)
    finally:
        spec.configure(model, [])
    return out


def test_decode_graph_buffer_is_filled_in_place(llama):
    """A DFlash decode graph hands every batch a slice of one shared buffer
    (``buffers.aux_hidden_states[:num_tokens]``); the packed result is that storage."""
    import torch

    spec, model = llama
    _, packed = _run(spec, model, LAYERS)
    assert isinstance(packed, torch.Tensor), f"a {type(packed).__name__} came back, not the packed tensor"
    width = len(LAYERS) * spec.tiny.hidden_size
    assert packed.shape == (TOKENS, width)
    shared = torch.full((TOKENS + 5, width), float("nan"), dtype=torch.float32)
    _, aux = _run(spec, model, LAYERS, buffer=shared[:TOKENS])
    assert aux.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    torch.testing.assert_close(shared[:TOKENS], packed)
    assert torch.isnan(shared[TOKENS:]).all(), "wrote past the batch's slice"


def test_causal_lm_reports_the_packed_width(llama):
    """What ``ModelRunner.get_aux_hidden_states_width`` reads to size that buffer: the
    real setter, then the real method; 0 until capture is configured."""
    from torch import nn

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )
    from sglang.srt.models.llama import LlamaForCausalLM

    spec, model = llama
    lm = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = types.SimpleNamespace(hidden_size=spec.tiny.hidden_size,
                                      num_hidden_layers=spec.tiny.num_layers)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    assert lm.get_aux_hidden_states_width() == 0
    dflash = types.SimpleNamespace(is_dflash_family=lambda: True)
    try:
        lm.set_dflash_layers_to_capture([i - 1 for i in LAYERS])
        want = len(LAYERS) * spec.tiny.hidden_size
        assert lm.get_aux_hidden_states_width() == want
        assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                               is_draft_worker=False) == want
        assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                               is_draft_worker=True) == 0
    finally:
        model.layers_to_capture = []
