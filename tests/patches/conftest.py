"""Fixtures shared by the start-up tests in tests/patches."""

from __future__ import annotations

import types

import pytest


def _tiny_lm(request, spec_name: str, module: str, lm_cls: str):
    """SGLang's real ``lm_cls`` of ``module`` (the setters the model runner calls, its
    ``config`` as the start-up reads it) over a tiny real model of spec ``spec_name`` with
    the test module's ``NUM_LAYERS`` layers (CPU stand-ins for attention and MLP)."""
    import dataclasses
    import importlib

    from torch import nn

    from harness.standins.models import build, specs

    num_layers = request.module.NUM_LAYERS
    spec = specs()[spec_name]
    tiny = dataclasses.replace(spec.tiny, num_layers=num_layers, dtype="float32")
    cls = getattr(importlib.import_module(module), lm_cls)
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = build(dataclasses.replace(spec, tiny=tiny), tiny)
    lm.config = types.SimpleNamespace(hidden_size=tiny.hidden_size,
                                      num_hidden_layers=num_layers)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


@pytest.fixture(scope="module")
def tiny_llama_lm(request, sglang_tp1):
    """``LlamaForCausalLM`` over a tiny real ``LlamaModel``: its modules keep their ids in
    ``layers_to_capture``, as most models' do."""
    return _tiny_lm(request, "llama", "sglang.srt.models.llama", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def tiny_kimi_linear_lm(request, sglang_tp1):
    """``KimiLinearForCausalLM`` over a tiny real ``KimiLinearModel`` (0.5.23): DSpark
    only, whose model keeps its ids in ``dspark_layers_to_capture`` (as kimi_k3's and
    deepseek_v4's do) and no ``layers_to_capture``."""
    return _tiny_lm(request, "kimi_linear", "sglang.srt.models.kimi_linear",
                    "KimiLinearForCausalLM")
