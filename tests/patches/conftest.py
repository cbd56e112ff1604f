"""Fixtures shared by the start-up tests in tests/patches."""

from __future__ import annotations

import types

import pytest



@pytest.fixture(scope="module")
def tiny_llama_lm(request, sglang_tp1):
    """SGLang's real ``LlamaForCausalLM`` (the setters the model runner calls, its
    ``config`` as the start-up reads it) over a tiny real ``LlamaModel`` of the test
    module's ``NUM_LAYERS`` layers (CPU stand-ins for attention and MLP)."""
    import dataclasses

    from sglang.srt.models.llama import LlamaForCausalLM
    from torch import nn

    from harness.standins.models import build, specs

    num_layers = request.module.NUM_LAYERS
    spec = specs()["llama"]
    tiny = dataclasses.replace(spec.tiny, num_layers=num_layers, dtype="float32")
    lm = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(lm)
    lm.model = build(dataclasses.replace(spec, tiny=tiny), tiny)
    lm.config = types.SimpleNamespace(hidden_size=tiny.hidden_size,
                                      num_hidden_layers=num_layers)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm
