"""Exact peak bytes of Inkling's capture path on 0.5.23, and its packed buffer
(``inkling-aux-packer``), without a model spec.

Inkling has no stand-in ModelSpec: its decoder layers leave a deferred short
convolution (``ShortConvUpdate``) on the residual stream, which needs the attention
backend's conv-state pool and Triton kernels (``ShortConvolution.forward``), and which
the generic suites' layer output (``ResidualStream.snapshot``) refuses by design
("snapshot requires a plain residual update"); the tap is taken *before* that
convolution, so it is not the snapshot either. A spec built with ``use_sconv=False``
would skip the very step that defines the tap. So, as
``tests/patches/test_final_capture_new_models.py`` does for the models it covers: the
real ``InklingCausalLLM.forward`` (and its real final read, ``_inkling_read``) over
whole-layer stand-ins on SGLang's real residual stream, each layer leaving its
contribution with a deferred channelwise "convolution" (``ShortConvUpdate``) for the
next boundary, as ``InklingDecoderLayer``'s MLP short convolution does.

The pristine 0.5.23 ``inkling.py`` (from the verified release wheel, loaded under a
module name of its own: :func:`harness.memory.models.pin_module`) against the patched
one, side by side in one process, measured as :func:`harness.memory.models._peak`
measures a spec's model: the captures the forward hands over plus what the logits
processor's ``pack_aux_hidden_states`` adds. List + cat: 2 x K*T*H*itemsize; the
packer: 1 x. Then the packed buffer itself: a DFlash decode graph's shared buffer,
sized by the reported width, is filled in place; an idle batch takes no captures.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.bases("0.5.23")

PATCH = "inkling-aux-packer"
HIDDEN = 16
NUM_LAYERS = 4
LAYER_IDS = [0, 2, NUM_LAYERS - 1]  # DFlash ids: layer outputs; the last in the loop


def _standins():
    import torch
    from torch import nn

    from sglang.srt.layers.layer_boundary.layout import SumGroup
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.short_conv import ShortConvUpdate

    def convolve(hidden_states, positions, forward_batch):
        return hidden_states * 2.0

    class DeferredConvLayer(nn.Module):
        """Applies the previous layer's deferred convolution at its entry (conv of the
        contribution plus the residual, written as the stream) and leaves
        ``layer_id + 1`` as its contribution, its own convolution deferred."""

        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id
            self.scattered_sconv = False
            self.attn_tp_group = None
            self.mlp_sconv = None
            self.mlp_ar_fusable = False

        def forward(self, hidden_states, positions, forward_batch, *, log_scaling_tau=None):
            if forward_batch.forward_mode.is_idle():
                return hidden_states
            stream = residual_batch.stream_of(forward_batch)
            value, residual = stream.input(hidden_states)
            if stream.pending is not None:
                value = stream.pending.update.update(stream.pending.complete(), residual)
            value = stream.write(value)
            update = ShortConvUpdate(convolve, None, SumGroup.TP).bind(forward_batch)
            return stream.record(torch.full_like(value, float(self.layer_id + 1)), update)

    class AddNorm(nn.Module):
        def forward(self, x, residual=None):
            if residual is None:
                return x * 0.5
            x = x + residual
            return x * 0.5, x

    return DeferredConvLayer, AddNorm


def _model(module, layer_ids=()):
    """``module.InklingCausalLLM`` (pristine or patched) with stand-in layers and norm."""
    from torch import nn

    Layer, Norm = _standins()
    cls = module.InklingCausalLLM
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(log_scaling_n_floor=None)
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    model.norm = Norm()
    model._final_read = module._inkling_read()
    model._dflash_layers_to_capture = set()
    if layer_ids:
        model.set_dflash_layers_to_capture(list(layer_ids))
    return model


def _forward(model, embeds, buffer=None, idle=False):
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.IDLE if idle else ForwardMode.EXTEND,
        residual_stream=None, aux_hidden_states_buffer=buffer,
        input_ids=torch.zeros(embeds.shape[0], dtype=torch.long),
        positions=torch.arange(embeds.shape[0]))
    with torch.no_grad():
        return model.forward(input_ids=None, positions=fb.positions, forward_batch=fb,
                             input_embeds=embeds)


def _expected(embeds, layer_ids):
    # Layer j's tap, before its deferred convolution: embeds + (j + 1) ** 2.
    import torch

    return torch.cat([embeds + float((j + 1) ** 2) for j in layer_ids], dim=-1)


def _capture_path_bytes(model, embeds):
    """The captures the forward returns plus what packing them adds (live storage)."""
    import torch

    from harness.memory.models import capture_path_bytes, pack_for_draft

    _, aux = _forward(model, embeds)
    torch.testing.assert_close(pack_for_draft(aux), _expected(embeds, LAYER_IDS))
    return capture_path_bytes(aux)


def _patched():
    from sglang.srt.models import inkling

    return inkling


@pytest.mark.guards(PATCH)
@pytest.mark.parametrize("tokens", [1, 96])
def test_goes_from_twice_to_once_the_captures(sglang_tp1, tokens):
    import torch

    from harness.memory.models import pin_module

    embeds = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    s = len(LAYER_IDS) * tokens * HIDDEN * embeds.element_size()
    pin = _capture_path_bytes(_model(pin_module("inkling"), LAYER_IDS), embeds)
    patched = _capture_path_bytes(_model(_patched(), LAYER_IDS), embeds)
    assert (pin, patched) == (2 * s, s), {"pin": pin, "patched": patched, "K*T*H*itemsize": s}


@pytest.mark.guards(PATCH)
def test_decode_graph_buffer_is_filled_in_place(sglang_tp1):
    """A DFlash decode graph hands every batch a slice of one shared buffer as wide as
    the model reports (``buffers.aux_hidden_states[:num_tokens]``); the packed result
    is that storage, and nothing past the slice is written."""
    import torch

    tokens = 7
    lm = _wrapper(_model(_patched()))
    lm.set_dflash_layers_to_capture(LAYER_IDS)
    width = lm.get_aux_hidden_states_width()
    embeds = torch.randn(tokens, HIDDEN)
    _, packed = _forward(lm.llm, embeds)
    assert isinstance(packed, torch.Tensor), f"a {type(packed).__name__} came back"
    assert packed.shape == (tokens, width)
    shared = torch.full((tokens + 5, width), float("nan"))
    _, aux = _forward(lm.llm, embeds, buffer=shared[:tokens])
    assert aux.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    torch.testing.assert_close(shared[:tokens], packed)
    torch.testing.assert_close(packed, _expected(embeds, LAYER_IDS))
    assert torch.isnan(shared[tokens:]).all(), "wrote past the batch's slice"


@pytest.mark.guards(PATCH)
def test_conditional_generation_reports_the_packed_width(sglang_tp1):
    """What ``ModelRunner.get_aux_hidden_states_width`` reads from the
    InklingForConditionalGeneration it holds: the real setter, then the real method;
    0 until capture is configured, and 0 for a draft worker."""
    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )

    lm = _wrapper(_model(_patched()))
    assert lm.get_aux_hidden_states_width() == 0
    lm.set_dflash_layers_to_capture(LAYER_IDS)
    want = len(LAYER_IDS) * HIDDEN
    dflash = types.SimpleNamespace(is_dflash_family=lambda: True)
    assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                           is_draft_worker=False) == want
    assert resolve_aux_hidden_states_width(model=lm, spec_algorithm=dflash,
                                           is_draft_worker=True) == 0


def test_idle_batch_takes_no_captures(sglang_tp1):
    """Unchanged by the patch: an idle batch returns ``(hidden_states, None)`` and leaves
    a graph buffer alone (the logits processor skips its check on idle batches)."""
    import torch

    shared = torch.full((0, len(LAYER_IDS) * HIDDEN), float("nan"))
    hidden, aux = _forward(_model(_patched(), LAYER_IDS), torch.randn(0, HIDDEN),
                           buffer=shared, idle=True)
    assert aux is None and hidden.shape == (0, HIDDEN)


def _wrapper(model):
    from torch import nn

    from sglang.srt.models.inkling import InklingForConditionalGeneration as cls

    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.llm = model
    lm.text_config = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
    return lm
