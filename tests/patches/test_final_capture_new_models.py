"""The last layer's capture in capturing models that are new in 0.5.23 (issue 17's
survey): glm5_next, nanbeige and interns2_mobius, whose final norm took no capture, so a
requested last layer came out K-1 of K (glm5_next, nanbeige) or, for interns2_mobius,
raised an IndexError in the inherited qwen3_5 setter. interns2_mobius reads the
per-layer flags in its own forward, so it must also capture by the list alone once
``models-capture-by-index`` drops the flags.

Each case runs the model's real ``forward`` on SGLang's real residual stream
(``residual_batch``), with decoder layers that add a known amount to the stream and a
final norm that, like the fused GPU kernel, updates its inputs in place. The models'
own decoder layers are checked through the stand-in matrix elsewhere; here the forward's
capture bookkeeping is the code under test. Also: the five 0.5.23 models whose last
capture cannot follow the final norm refuse ``post_norm`` at start-up, in the real
``configure_aux_hidden_state_capture``.
"""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.bases("0.5.23")]

NUM_LAYERS = 3
HIDDEN = 4
TOKENS = 5


def _stream_layer_cls():
    import torch
    from torch import nn

    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD

    class StreamLayer(nn.Module):
        """Layer ``k`` folds the stream (its input: the output of layer k - 1), captures
        it when asked, and adds ``10 * (k + 1)``, left to the next read."""

        def __init__(self, layer_id, returns_topk=False):
            super().__init__()
            self.layer_id = layer_id
            self.returns_topk = returns_topk

        def forward(self, positions, hidden_states, forward_batch, *args,
                    capture_output=None, captured_last_layer_outputs=None, **kwargs):
            hidden_states = residual_batch.fold(hidden_states, forward_batch)
            if capture_output is not None:
                capture_output(hidden_states)
            if captured_last_layer_outputs is not None:
                captured_last_layer_outputs.capture(hidden_states)
            added = torch.full_like(hidden_states, 10.0 * (self.layer_id + 1))
            out = residual_batch.stream_of(forward_batch).record(added, PLAIN_ADD)
            return (out, None) if self.returns_topk else out

    class FusedAddScaleNorm(nn.Module):
        """``residual += hidden``; output ``3 * residual - 1``, both in place."""

        def forward(self, hidden_states, residual=None):
            if residual is None:
                return hidden_states * 3.0 - 1.0
            residual.add_(hidden_states)
            hidden_states.copy_(residual * 3.0 - 1.0)
            return hidden_states, residual

    return StreamLayer, FusedAddScaleNorm


def _build(name):
    from torch import nn

    StreamLayer, Norm = _stream_layer_cls()
    if name == "muse_glimmer":
        return _build_muse_glimmer()
    if name == "glm5_next":
        from sglang.srt.models.glm5_next import Glm5NextModel as cls
    elif name == "nanbeige":
        from sglang.srt.models.nanbeige import NanbeigeModel as cls
    else:
        from sglang.srt.models.interns2_mobius import InternS2MobiusForCausalLM as cls
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [StreamLayer(i, returns_topk=name == "glm5_next") for i in range(NUM_LAYERS)])
    model.norm = Norm()
    model.layers_to_capture = []
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    if name == "interns2_mobius":
        # What make_layers returns without PP (interns2_mobius.py __init__), read by
        # qwen3_5's start_layer / end_layer properties.
        model._start_layer, model._end_layer = 0, NUM_LAYERS
    else:
        model.start_layer, model.end_layer = 0, NUM_LAYERS
    if name == "glm5_next":
        model.dflash_capture = False
        model.enable_a2a_moe = False
        model.first_k_dense_replace = 0
        model.config = types.SimpleNamespace(mhc=False)
    elif name == "nanbeige":
        model.config = types.SimpleNamespace(num_loops=1, num_hidden_layers=NUM_LAYERS,
                                             skip_loop_final_norm=True)
    else:
        model.meta_mlp = None
        model.hidden_size = HIDDEN
    return model


def _build_muse_glimmer():
    """MuseGlimmerForCausalLM's model: plain layers that return the whole stream and an
    unfused final norm (``3 * h - 1``), set through the wrapper's real setter."""
    from torch import nn

    from sglang.srt.models.muse_glimmer import MuseGlimmerForCausalLM, MuseGlimmerModel

    class PlainLayer(nn.Module):
        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id

        def forward(self, positions, hidden_states, forward_batch):
            return hidden_states + 10.0 * (self.layer_id + 1)

    model = MuseGlimmerModel.__new__(MuseGlimmerModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([PlainLayer(i) for i in range(NUM_LAYERS)])
    model.norm = _stream_layer_cls()[1]()  # called without a residual: 3 * h - 1
    model.embed_norm = None
    model.layers_to_capture = []
    wrapper = MuseGlimmerForCausalLM.__new__(MuseGlimmerForCausalLM)
    nn.Module.__init__(wrapper)
    wrapper.model = model
    model._wrapper = [wrapper]  # not a submodule
    return model


def _set_ids(model, name, ids):
    """What the model's own setter stores: interns2_mobius through qwen3_5's setter (the
    one its wrappers reach), the others the ``layers_to_capture`` list."""
    if name == "interns2_mobius":
        model.set_dflash_layers_to_capture(list(ids))
    elif name == "muse_glimmer":
        model._wrapper[0].set_dflash_layers_to_capture(list(ids))
    else:
        model.layers_to_capture = list(ids)


def _forward(model, embeds, idle=False, tbo=False, embeds_kw="input_embeds"):
    """(hidden, aux or None) of the model's real forward on ``embeds``; ``tbo``: a batch
    that could run two-batch overlap; ``embeds_kw``: how the forward names its input."""
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    forward_batch = types.SimpleNamespace(
        can_run_tbo=tbo, residual_stream=None, aux_hidden_states_buffer=None,
        forward_mode=ForwardMode.IDLE if idle else ForwardMode.EXTEND)
    out = model.forward(input_ids=None, positions=torch.arange(embeds.shape[0]),
                        forward_batch=forward_batch, **{embeds_kw: embeds})
    return out if isinstance(out, tuple) else (out, None)


def _after(embeds, n):
    # The stream after layers 0..n-1.
    return embeds + 10.0 * sum(range(1, n + 1))


MODELS = ["glm5_next", "nanbeige", "interns2_mobius", "muse_glimmer"]


@pytest.mark.guards("models-capture-final-layer")
@pytest.mark.parametrize("name", MODELS)
def test_requested_last_layer_is_captured_k_of_k(sglang_tp1, name):
    import torch

    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    model = _build(name)
    _set_ids(model, name, [1, NUM_LAYERS])
    embeds = torch.randn(TOKENS, HIDDEN)
    hidden, aux = _forward(model, embeds.clone())
    assert aux is not None, f"{name}: no aux hidden states came back"
    packed = pack_aux_hidden_states(aux)
    assert packed.shape == (TOKENS, 2 * HIDDEN), f"{name}: captured {packed.shape[-1] // HIDDEN} of 2"
    first, last = packed.split(HIDDEN, dim=-1)
    torch.testing.assert_close(first, _after(embeds, 1))
    # pre_norm: the stream entering the final norm, h + r, kept apart from the norm's
    # in-place update of its inputs.
    torch.testing.assert_close(last, _after(embeds, NUM_LAYERS))
    torch.testing.assert_close(hidden, _after(embeds, NUM_LAYERS) * 3.0 - 1.0)


@pytest.mark.guards("models-capture-final-layer")
def test_qwen3_5_text_dflash_setter_takes_the_last_layer(sglang_tp1):
    """qwen3_5_text.Qwen3_5ForCausalLM's DFlash setter refused target id num_layers - 1 (the
    last layer's output), which its qwen3_5 body now captures at the final norm."""
    from torch import nn

    from sglang.srt.models.qwen3_5_text import Qwen3_5ForCausalLM as Qwen3_5TextForCausalLM

    body_ids = []
    wrapper = Qwen3_5TextForCausalLM.__new__(Qwen3_5TextForCausalLM)
    nn.Module.__init__(wrapper)
    wrapper.pp_group = types.SimpleNamespace(world_size=1, is_last_rank=True)
    wrapper.model = types.SimpleNamespace(
        layers=[None] * NUM_LAYERS, set_dflash_layers_to_capture=body_ids.append)
    wrapper.set_dflash_layers_to_capture([0, NUM_LAYERS - 1])
    assert body_ids == [[1, NUM_LAYERS]]
    with pytest.raises(ValueError, match="target_layer_ids must be"):
        wrapper.set_dflash_layers_to_capture([0, NUM_LAYERS])


@pytest.mark.guards("models-capture-by-index")
def test_interns2_mobius_captures_by_the_list(sglang_tp1):
    """The list is the only record (models-capture-by-index): code that sets
    ``layers_to_capture`` itself, as qwen3_vl's wrapper does, gets K of K. Without
    the patch interns2_mobius's own forward reads per-layer flags and captures nothing,
    returning a bare tensor to a wrapper that unpacks a pair."""
    import torch

    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    model = _build("interns2_mobius")
    model.layers_to_capture = [1, 2]
    embeds = torch.randn(TOKENS, HIDDEN)
    _, aux = _forward(model, embeds.clone())
    assert aux is not None, "interns2_mobius: no aux hidden states came back"
    torch.testing.assert_close(pack_aux_hidden_states(aux),
                               torch.cat([_after(embeds, 1), _after(embeds, 2)], dim=-1))


@pytest.mark.guards("models-capture-final-layer")
def test_glm5_next_idle_batch_captures_last_layer(sglang_tp1):
    import torch

    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    model = _build("glm5_next")
    model.layers_to_capture = [1, NUM_LAYERS]
    _, aux = _forward(model, torch.empty(0, HIDDEN), idle=True)
    assert tuple(pack_aux_hidden_states(aux).shape) == (0, 2 * HIDDEN)


@pytest.mark.guards("final-layer-capture")
@pytest.mark.parametrize("name", MODELS)
def test_post_norm_last_capture_is_the_final_norm_output(sglang_tp1, name):
    import torch

    from harness.suites.models import serving_final_layer_capture
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    model = _build(name)
    _set_ids(model, name, [1, NUM_LAYERS])
    embeds = torch.randn(TOKENS, HIDDEN)
    with serving_final_layer_capture("post_norm", model):
        hidden, aux = _forward(model, embeds.clone())
    last = pack_aux_hidden_states(aux).split(HIDDEN, dim=-1)[-1]
    torch.testing.assert_close(last, _after(embeds, NUM_LAYERS) * 3.0 - 1.0)
    torch.testing.assert_close(last, hidden)


def _kimi_linear(ids):
    """KimiLinearModel: capture ids are layer outputs, each a snapshot after its layer;
    the last layer's is taken in the loop, or (post_norm) after the final norm."""
    from torch import nn

    from sglang.srt.models.kimi_linear import KimiLinearModel

    StreamLayer, Norm = _stream_layer_cls()
    model = KimiLinearModel.__new__(KimiLinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([StreamLayer(i) for i in range(NUM_LAYERS)])
    model.norm = Norm()
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.dspark_layers_to_capture = list(ids)
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _muse_spark(ids):
    """MuseSpark1xModel: an fp32 residual stream, layers that return (stream, next
    attention input), capture ids that are layer outputs (in operator dtype)."""
    import torch
    from torch import nn

    from sglang.srt.models.muse_spark import MuseSpark1xModel

    class Layer(nn.Module):
        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id

        def self_attn_input_norm(self, stream):
            return stream

        def forward(self, positions, stream, attn_input, forward_batch):
            return stream + 10.0 * (self.layer_id + 1), stream

    model = MuseSpark1xModel.__new__(MuseSpark1xModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    model.norm = _stream_layer_cls()[1]()  # called without a residual: 3 * h - 1
    model.embed_norm = None
    model.residual_dtype = torch.float64
    model.operator_dtype = torch.float32
    model.layers_to_capture = list(ids)
    return model


@pytest.mark.parametrize("name", ["kimi_linear", "muse_spark"])
@pytest.mark.parametrize("value", [
    # pre_norm is what pristine 0.5.23 serves: kept, and guarded by nothing.
    "pre_norm",
    pytest.param("post_norm", marks=pytest.mark.guards("final-layer-capture")),
])
def test_in_loop_models_serve_both_sides_of_the_final_norm(sglang_tp1, name, value):
    """Their ids name layer outputs and the last one was taken inside the loop:
    pre_norm keeps it there (the stream entering the final norm), post_norm takes the
    final norm's output instead."""
    import torch

    from harness.suites.models import serving_final_layer_capture
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    ids = [0, NUM_LAYERS - 1]
    model = (_kimi_linear if name == "kimi_linear" else _muse_spark)(ids)
    embeds = torch.randn(TOKENS, HIDDEN, dtype=torch.float32)
    embeds_kw = "inputs_embeds" if name == "kimi_linear" else "input_embeds"
    with serving_final_layer_capture(value, model):
        hidden, aux = _forward(model, embeds.clone(), embeds_kw=embeds_kw)
    # A list (muse_spark), or one packed tensor (kimi_linear, kimi-linear-aux-packer).
    packed = pack_aux_hidden_states(aux)
    assert packed.shape[-1] == 2 * HIDDEN, f"{name}: {packed.shape[-1] // HIDDEN} captures for 2 ids"
    first, last = (t.to(torch.float32) for t in packed.split(HIDDEN, dim=-1))
    torch.testing.assert_close(first, _after(embeds, 1))
    stream = _after(embeds, NUM_LAYERS)
    torch.testing.assert_close(hidden.to(torch.float32), stream * 3.0 - 1.0)
    torch.testing.assert_close(last, stream if value == "pre_norm" else stream * 3.0 - 1.0)
    if value == "post_norm":
        assert last.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()


# The models whose last capture cannot follow the final norm: module, the class the
# model runner configures. inkling captures it inside its layer loops (its capture
# precedes the layer's deferred short convolution by design), deepseek_v4's final norm
# follows its hyper-connection head. (beam did, until beam-post-norm-capture.)
REFUSE_POST_NORM = [
    ("inkling", "InklingForConditionalGeneration"),
    ("deepseek_v4", "DeepseekV4ForCausalLM"),
]


def _configure(model, value, dflash=True):
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup

    attention_backend_setup.configure_aux_hidden_state_capture(
        model=model,
        eagle_use_aux_hidden_state=False,
        eagle_aux_hidden_state_layer_ids=None,
        dflash_use_aux_hidden_state=dflash,
        dflash_target_layer_ids=[0, 1],
        is_dspark=True,
        final_layer_capture=value,
    )


@pytest.mark.guards("final-layer-capture")
@pytest.mark.parametrize("module, cls", REFUSE_POST_NORM, ids=[m for m, _ in REFUSE_POST_NORM])
def test_in_loop_models_refuse_post_norm_at_start_up(sglang_tp1, module, cls):
    import importlib

    from torch import nn

    from sglang.srt.layers.aux_hidden_states import final_layer_capture_post_norm

    model_cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls)
    # The declaration is a boolean the model runner reads (issue 28: 0.5.23's 0038, post_norm).
    assert model_cls.supports_post_norm_final_layer_capture is False
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    set_calls = []
    model.set_dflash_layers_to_capture = set_calls.append
    model.set_dspark_layers_to_capture = set_calls.append
    with pytest.raises(ValueError) as info:
        _configure(model, "post_norm")
    message = str(info.value)
    assert "\n" not in message and cls in message and "post_norm" in message, message
    # Refused before anything changed: no setter ran, nothing holds the setting.
    assert set_calls == [] and not final_layer_capture_post_norm(model)
    # pre_norm, what they serve, still configures.
    _configure(model, "pre_norm")
    assert set_calls == [[0, 1]]


@pytest.mark.guards("models-capture-skips-tbo")
@pytest.mark.parametrize("name", ["glm5_next", "minimax_m3"])
def test_capturing_model_runs_no_layer_through_tbo_stages(sglang_tp1, name):
    """glm5_next gated two-batch overlap on DFlash captures only, minimax_m3 not at all:
    a TBO batch with EAGLE3 captures ran its layers through ``model_forward_stages``,
    whose stages take no captures. (Latent today: OperationsStrategy has no TBO plan for
    either layer class.)"""
    from unittest import mock

    import torch

    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    if name == "glm5_next":
        from sglang.srt.models import glm5_next as module

        model = _build("glm5_next")
        model.first_k_dense_replace = 1
    else:
        from torch import nn

        from sglang.srt.models import minimax_m3 as module

        StreamLayer, Norm = _stream_layer_cls()
        model = module.MiniMaxM3Model.__new__(module.MiniMaxM3Model)
        nn.Module.__init__(model)
        model.layers = nn.ModuleList([StreamLayer(i) for i in range(NUM_LAYERS)])
        model.norm = Norm()
        model.finalize_norm = None
        model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
        model.start_layer, model.end_layer = 0, NUM_LAYERS
    ids = [1, 2]
    model.layers_to_capture = list(ids)
    for i in ids:  # minimax_m3's forward reads the flags its CausalLM's setter sets
        model.layers[i]._is_layer_to_capture = True
    embeds = torch.randn(TOKENS, HIDDEN)
    with mock.patch.object(module, "model_forward_stages") as stages:
        _, aux = _forward(model, embeds.clone(), tbo=True)
    assert not stages.called, f"{name}: layers went through the TBO stages while capturing"
    torch.testing.assert_close(pack_aux_hidden_states(aux),
                               torch.cat([_after(embeds, 1), _after(embeds, 2)], dim=-1))


@pytest.mark.guards("beam-post-norm-capture")
def test_beam_is_configured_for_post_norm(sglang_tp1):
    """BeamForCausalLM no longer refuses post_norm at start-up: the model runner sets it
    and calls the DFlash setter (its loops take the last capture after the final norm,
    which the model matrix checks for both loops)."""
    from torch import nn

    from sglang.srt.layers.aux_hidden_states import final_layer_capture_post_norm
    from sglang.srt.models.beam import BeamForCausalLM, BeamModel

    model = BeamForCausalLM.__new__(BeamForCausalLM)
    nn.Module.__init__(model)
    model.model = BeamModel.__new__(BeamModel)
    nn.Module.__init__(model.model)
    model.model.layers_to_capture = []
    set_calls = []

    def set_ids(ids):
        set_calls.append(ids)
        model.model.layers_to_capture = list(ids)

    model.set_dflash_layers_to_capture = set_ids
    model.set_dspark_layers_to_capture = set_ids
    _configure(model, "post_norm")
    # The setting is held by the module whose forward reads it, the one that keeps
    # the ids the setter set.
    assert set_calls == [[0, 1]] and final_layer_capture_post_norm(model.model)
