"""The packed aux hidden states of the 0.5.23 packer migration, one family per patch
(the *-aux-packer patches; each model's is its spec's fix for B, or for G where
upstream already packed: deepseek_v2 and mimo_v2): the forward returns one
[T, K * H] buffer, fills a DFlash decode graph's shared buffer when the batch carries
one, and its CausalLM reports that buffer's width to the model runner.

Tiny real models (CPU stand-ins for attention and MLP only, as in the model matrix).
That the packed captures equal the layers' complete outputs is checked for every model
in ``tests/patches/test_model_forward.py`` (``test_returns_packed_captures``, each
migrated model guarded by its family's patch); here the run without a graph buffer is
the reference.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from harness.standins.models import specs

pytestmark = pytest.mark.bases("0.5.23")

TOKENS = 7
LAYERS = [2, 4, 8]  # 8 = end_layer of the 8-layer tiny models: the final norm's capture

# Each migrated model (its spec) and the CausalLM the model runner holds, from the
# spec's module; the patch each guards is the spec's own fix for B.
CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "apertus": "ApertusForCausalLM",
    "arcee": "ArceeForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "exaone_moe": "ExaoneMoEForCausalLM",
    "longcat_flash": "LongcatFlashForCausalLM",
    "bailing_moe": "BailingMoEForCausalLM",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma4": "Gemma4ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "laguna": "LagunaForCausalLM",
    "nanbeige": "NanbeigeForCausalLM",
    "glm5_next": "Glm5NextForConditionalGeneration",
    "minimax_m3": "MiniMaxM3SparseForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    # The multimodal MuseGlimmerForConditionalGeneration inherits its width.
    "muse_glimmer": "MuseGlimmerForCausalLM",
    # Both of BeamModel's loops: the fused one and the plain one (CPU offload).
    "beam": "BeamForCausalLM",
    "beam_unfused": "BeamForCausalLM",
    # Upstream's packers that took no graph buffer and reported no width (G).
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "mimo_v2": "MiMoV2ForCausalLM",
}


def _guard(spec) -> str:
    """The patch whose tests these are: the spec's fix for G (upstream packed, but
    without the graph's buffer or a width), else its family's packer migration (B)."""
    return spec.patch_for("G") if "G" in spec.bugs() else spec.patch_for("B")


# Collected on every base; the files new in 0.5.23 have no spec on the pin.
PARAMS = [pytest.param(name, marks=pytest.mark.guards(_guard(specs()[name])), id=name)
          for name in CAUSAL_LM if name in specs()]

_BUILT: dict = {}


def _tiny(name):
    """The spec at float32 and its tiny real model, built once per worker."""
    from harness.standins.models import build

    if name not in _BUILT:
        spec = specs()[name]
        tiny = dataclasses.replace(spec.tiny, dtype="float32")
        spec = dataclasses.replace(spec, tiny=tiny)
        _BUILT[name] = spec, build(spec, tiny)
    return _BUILT[name]


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


@pytest.mark.parametrize("name", PARAMS)
def test_decode_graph_buffer_is_filled_in_place(sglang_tp1, name):
    """A DFlash decode graph hands every batch a slice of one shared buffer
    (``buffers.aux_hidden_states[:num_tokens]``); the packed result is that storage."""
    import torch

    spec, model = _tiny(name)
    _, packed = _run(spec, model, LAYERS)
    assert isinstance(packed, torch.Tensor), f"a {type(packed).__name__} came back, not the packed tensor"
    width = len(LAYERS) * spec.tiny.hidden_size
    assert packed.shape == (TOKENS, width)
    shared = torch.full((TOKENS + 5, width), float("nan"), dtype=torch.float32)
    _, aux = _run(spec, model, LAYERS, buffer=shared[:TOKENS])
    assert aux.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    torch.testing.assert_close(shared[:TOKENS], packed)
    assert torch.isnan(shared[TOKENS:]).all(), "wrote past the batch's slice"


@pytest.mark.parametrize("name", PARAMS)
def test_causal_lm_reports_the_packed_width(sglang_tp1, name):
    """What ``ModelRunner.get_aux_hidden_states_width`` reads to size that buffer: the
    real setter, then the real method; 0 until capture is configured."""
    import importlib

    from torch import nn

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )

    spec, model = _tiny(name)
    lm_cls = getattr(importlib.import_module(spec.module), CAUSAL_LM[name])
    lm = lm_cls.__new__(lm_cls)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = types.SimpleNamespace(hidden_size=spec.tiny.hidden_size,
                                      num_hidden_layers=spec.tiny.num_layers)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    if not isinstance(getattr(lm_cls, "capture_aux_hidden_states", None), property):
        lm.capture_aux_hidden_states = False  # else read from the model (lfm2)
    assert lm.get_aux_hidden_states_width() == 0
    dflash = types.SimpleNamespace(is_dflash_family=lambda: True)
    try:
        # The DFlash setter; EAGLE3's (the same id + 1 mapping) where the CausalLM has
        # none (minimax_m3's text CausalLM: its VL wrapper's is in the template).
        # DSpark's (layer-output ids, as DFlash's) where it is the only one (kimi_linear).
        setter = (getattr(lm, "set_dflash_layers_to_capture", None)
                  or getattr(lm, "set_dspark_layers_to_capture", None)
                  or lm.set_eagle3_layers_to_capture)
        setter([i - 1 for i in LAYERS])
        want = len(LAYERS) * spec.tiny.hidden_size
        assert lm.get_aux_hidden_states_width() == want
        assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                               is_draft_worker=False) == want
        assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                               is_draft_worker=True) == 0
    finally:
        spec.configure(model, [])


@pytest.mark.guards(specs()["qwen3_5"].patch_for("B"))
def test_minicpmv_4_6_reports_its_qwen3_5_body_width(sglang_tp1):
    """MiniCPM-V 4.6/4.7 run a Qwen3.5 body (``self.llm``) under the version dispatcher
    the model runner holds (``MiniCPMV.__getattr__`` forwards to the 4.6 model): the
    width comes through it, from the tiny real body after the real DFlash setter."""
    from torch import nn

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )
    from sglang.srt.models.minicpmv import MiniCPMV4_6, MiniCPMV4_6ForConditionalGeneration

    spec, body = _tiny("qwen3_5")
    inner = MiniCPMV4_6.__new__(MiniCPMV4_6)
    nn.Module.__init__(inner)
    inner.llm = body
    inner.config = types.SimpleNamespace(
        text_config=types.SimpleNamespace(hidden_size=spec.tiny.hidden_size))
    inner.capture_aux_hidden_states = False
    runner_model = MiniCPMV4_6ForConditionalGeneration.__new__(MiniCPMV4_6ForConditionalGeneration)
    runner_model.minicpmv = inner
    dflash = types.SimpleNamespace(is_dflash_family=lambda: True)

    def width():
        return resolve_aux_hidden_states_width(model=runner_model, spec_algorithm=dflash,
                                               is_draft_worker=False)

    assert width() == 0
    try:
        runner_model.set_dflash_layers_to_capture([i - 1 for i in LAYERS])
        want = width()
        assert want == len(LAYERS) * spec.tiny.hidden_size
        _, packed = _run(spec, body, LAYERS)
        assert packed.shape[1] == want, "the width reported is not what the body returns"
    finally:
        spec.configure(body, [])
