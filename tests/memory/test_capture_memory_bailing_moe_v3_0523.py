"""Exact peak bytes of bailing_moe_v3's DSpark capture path on 0.5.23 (the
bailing-moe-v3-aux-packer patch), and the packed width and decode-graph buffer reuse.

bailing_moe_v3 has no stand-in spec (its decoder layers need KDA and MLA attention on
the layer boundaries, and its stage facts a Ling-V3 config), so this is the memory
route without one: the real ``BailingMoELinearModel.forward`` of pristine 0.5.23 (read
from the verified release wheel, loaded under a module name of its own) and of the
patched tree, side by side in one process, each over whole-layer stand-ins on SGLang's
real residual stream (``residual_batch``), as ``tests/patches/test_final_capture_new_models.py``
runs the new 0.5.23 forwards. Two exact live-storage figures (CPU):

* the capture path as ``harness.memory.models._peak`` measures it: the captures the
  forward hands over plus what ``pack_aux_hidden_states`` adds;
* everything the forward and the pack allocate, the stand-ins' own compute left out
  (it runs with the tracker suspended), so only the model's capture bookkeeping counts.

list + cat: 2 x K*T*H*itemsize; the packer: 1 x. Only the last pipeline stage captures
(the setter does nothing elsewhere), so one stage is the whole story.
"""

from __future__ import annotations

import types

import pytest

from harness.memory.models import capture_path_bytes
from harness.memory.tracker import untracked

pytestmark = pytest.mark.bases("0.5.23")

GUARD = pytest.mark.guards("bailing-moe-v3-aux-packer")
NUM_LAYERS = 6
HIDDEN = 16
IDS = [1, 3, NUM_LAYERS - 1]  # layer outputs; the last is the final norm's capture


def _standins():
    import torch
    from torch import nn

    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD

    class Layer(nn.Module):
        """Completes the previous layer's output at its boundary, hands it to
        ``capture_output`` when asked (as the attention boundary does), and adds
        ``layer_id + 1``, left to the next boundary or the final norm."""

        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id

        def forward(self, hidden_states, positions, forward_batch, zero_allocator,
                    capture_output=None):
            with untracked():
                hidden_states = residual_batch.fold(hidden_states, forward_batch)
            if capture_output is not None:
                capture_output(hidden_states)
            with untracked():
                added = torch.full_like(hidden_states, float(self.layer_id + 1))
                return residual_batch.stream_of(forward_batch).record(added, PLAIN_ADD)

    class Norm(nn.Module):
        """Fused add + norm (``0.5 * (h + r)``), in place like the GPU kernel."""

        def forward(self, hidden_states, residual=None):
            with untracked():
                if residual is None:
                    return hidden_states.mul_(0.5)
                residual.add_(hidden_states)
                hidden_states.copy_(residual * 0.5)
                return hidden_states, residual

    return Layer, Norm


class _NoBump:
    """The layers' scratch allocator: the stand-ins take none."""

    def __init__(self, **unused):
        pass


def _lm(module, ids=IDS):
    """BailingMoeV3ForCausalLM of ``module`` over a real BailingMoELinearModel with
    stand-in layers, configured by the real DSpark setter."""
    from torch import nn

    Layer, Norm = _standins()
    model = module.BailingMoELinearModel.__new__(module.BailingMoELinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.norm = Norm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.layers_to_capture = None
    model.capture_aux_hidden_states = False
    lm = module.BailingMoeV3ForCausalLM.__new__(module.BailingMoeV3ForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.pp_group = model.pp_group
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm.capture_aux_hidden_states = False
    if ids is not None:
        lm.set_dspark_layers_to_capture(list(ids))
    return lm


def _batch(buffer=None):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    return types.SimpleNamespace(
        can_run_tbo=False, residual_stream=None, forward_mode=ForwardMode.EXTEND,
        capture_hidden_mode=CaptureHiddenMode.FULL, aux_hidden_states_buffer=buffer)


def _forward(model, embeds, buffer=None, positions=None, forward_batch=None):
    import torch

    if positions is None:
        positions = torch.arange(embeds.shape[0])
    with torch.no_grad():
        return model.forward(input_ids=None, positions=positions,
                             forward_batch=forward_batch or _batch(buffer),
                             input_embeds=embeds)


def _after(embeds, layer_id):
    return embeds + float(sum(range(1, layer_id + 2)))


def _peaks(module, embeds, monkeypatch):
    """(held + pack, as ``_peak``; all the forward and the pack allocate) of one model."""
    import torch

    from harness.memory.models import pack_for_draft

    from harness.memory.tracker import make_tracker

    monkeypatch.setattr(module, "BumpAllocator", _NoBump)
    model = _lm(module).model
    _, aux = _forward(model, embeds.clone())
    capture_path = capture_path_bytes(aux)
    del aux
    # The forward's inputs exist before it runs: the tracker's baseline.
    source, positions, batch = embeds.clone(), torch.arange(embeds.shape[0]), _batch()
    with make_tracker("cpu") as tracker:
        _, aux = _forward(model, source, positions=positions, forward_batch=batch)
        packed = pack_for_draft(aux)
    del aux, packed
    return capture_path, int(tracker.peak_bytes)


@GUARD
@pytest.mark.parametrize("tokens", [1, 96])
def test_goes_from_twice_to_once_the_captures(sglang_tp1, monkeypatch, tokens):
    import torch

    from harness.memory.models import pin_module
    from sglang.srt.models import bailing_moe_v3

    embeds = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
    once = len(IDS) * tokens * HIDDEN * embeds.element_size()
    pin = _peaks(pin_module("bailing_moe_v3"), embeds, monkeypatch)
    patched = _peaks(bailing_moe_v3, embeds, monkeypatch)
    assert pin == (2 * once, 2 * once), (pin, once)
    assert patched == (once, once), (patched, once)


@GUARD
def test_width_and_decode_graph_buffer_reuse(sglang_tp1):
    """What the model runner reads to size a DFlash-family decode graph's shared
    buffer, and that the forward fills a slice of it in place."""
    import torch

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )
    from sglang.srt.models import bailing_moe_v3

    dspark = types.SimpleNamespace(is_dflash_family=lambda: True)
    assert _lm(bailing_moe_v3, ids=None).get_aux_hidden_states_width() == 0
    lm = _lm(bailing_moe_v3)
    width = len(IDS) * HIDDEN
    assert resolve_aux_hidden_states_width(
        model=lm, spec_algorithm=dspark, is_draft_worker=False) == width
    assert resolve_aux_hidden_states_width(
        model=lm, spec_algorithm=dspark, is_draft_worker=True) == 0
    tokens = 7
    embeds = torch.randn(tokens, HIDDEN)
    _, packed = _forward(lm.model, embeds.clone())
    assert isinstance(packed, torch.Tensor) and packed.shape == (tokens, width)
    torch.testing.assert_close(packed, torch.cat([_after(embeds, i) for i in IDS], dim=-1))
    shared = torch.full((tokens + 5, width), float("nan"))
    _, aux = _forward(lm.model, embeds.clone(), buffer=shared[:tokens])
    assert aux.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    torch.testing.assert_close(shared[:tokens], packed)
    assert torch.isnan(shared[tokens:]).all(), "wrote past the batch's slice"
