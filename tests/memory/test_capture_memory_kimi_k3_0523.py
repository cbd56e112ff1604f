"""Exact peak bytes of kimi_k3's DSpark capture path across two pipeline stages on
0.5.23 (the kimi-k3-pp-aux-packer patch), and the per-stage packed width and
decode-graph buffer reuse.

Pristine 0.5.23 packs kimi_k3's captures already without pipeline parallelism, but with
PP > 1 each stage collected a list: a stage that is not the last concatenated its own
into ``pp_proxy_tensors["dspark_hidden_states"]`` and the last concatenated the received
block with its own captures. kimi_k3 has no stand-in spec (MLA and KDA attention on the
layer boundaries, the attention-residual bank), so this is the memory route without one:
the real ``KimiK3LinearModel.forward`` of pristine 0.5.23 (read from the verified
release wheel, loaded under a module name of its own) and of the patched tree, side by
side in one process, each run as two stages with its pipeline group overridden (as the
kimi_linear template of kimi-linear-aux-packer does), over whole-layer stand-ins on
SGLang's real residual stream whose own compute runs with the tracker suspended. Exact
live-storage figures (CPU), with s = T*H*itemsize, K1 captures on the first stage and
K = K1 + K2 on the last:

* first stage, everything its forward allocates: 2 x K1*s (list + cat) -> 1 x;
* last stage, as ``harness.memory.models._peak`` measures it (the captures the forward
  hands over, the received block among them, plus what ``pack_aux_hidden_states``
  adds): 2 x K*s -> 1 x;
* last stage, everything its forward and the pack allocate (the received block is the
  caller's): (K2 + K)*s -> K*s.
"""

from __future__ import annotations

import types

import pytest

from harness.memory.models import capture_path_bytes
from harness.memory.tracker import untracked

pytestmark = pytest.mark.bases("0.5.23")

GUARD = pytest.mark.guards("kimi-k3-pp-aux-packer")
NUM_LAYERS = 6
SPLIT = 3  # the first stage runs layers 0-2, the last 3-5
HIDDEN = 16
# Layer outputs. The first stage packs id 0; id 2, its last layer's output, is the
# stream the last stage receives and captures first; 5 is the final norm's capture.
IDS = [0, 2, 3, NUM_LAYERS - 1]
K1 = 1


def _standins():
    import torch
    from torch import nn

    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD

    class FromPP:
        """A stage's entry: a fresh stream holding the received output."""

        def from_pp(self, pp_proxy_tensors, forward_batch):
            with untracked():
                residual_batch.start(forward_batch)
                return pp_proxy_tensors["hidden_states"] + pp_proxy_tensors["residual"]

    class Layer(nn.Module):
        """Completes the previous layer's output at its boundary, hands it to
        ``capture_gathered`` when asked (as the attention boundary does), and adds
        ``layer_id + 1``, left to the next boundary or the final read."""

        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id
            self.attn_boundary = FromPP()

        def forward(self, positions, hidden_states, forward_batch, zero_allocator,
                    capture_gathered=None):
            with untracked():
                hidden_states = residual_batch.fold(hidden_states, forward_batch)
            if capture_gathered is not None:
                capture_gathered.capture(hidden_states)
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


def _lm(module, start_layer=0, end_layer=NUM_LAYERS, ids=IDS):
    """KimiK3LinearForCausalLM of ``module`` for one pipeline stage, over a real
    KimiK3LinearModel with stand-in layers (the standard residual path: no bank),
    configured by the real DSpark setter."""
    from torch import nn

    Layer, Norm = _standins()
    model = module.KimiK3LinearModel.__new__(module.KimiK3LinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = start_layer, end_layer
    model.dspark_layers_to_capture = None
    model.carries_bank_slices = False
    model.attn_bank = None
    model._final_read = Norm()
    whole = start_layer == 0 and end_layer == NUM_LAYERS
    model.pp_group = types.SimpleNamespace(
        is_first_rank=start_layer == 0, is_last_rank=end_layer == NUM_LAYERS,
        world_size=1 if whole else 2, rank_in_group=0 if start_layer == 0 else 1)
    model.config = types.SimpleNamespace(hidden_size=HIDDEN)
    lm = module.KimiK3LinearForCausalLM.__new__(module.KimiK3LinearForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = model.config
    lm.capture_aux_hidden_states = False
    if ids is not None:
        lm.set_dspark_layers_to_capture(list(ids))
    return lm


def _batch(buffer=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(can_run_tbo=False, residual_stream=None,
                                 forward_mode=ForwardMode.EXTEND,
                                 aux_hidden_states_buffer=buffer)


def _forward(model, embeds, positions, forward_batch, pp_proxy_tensors=None):
    import torch

    from sglang.srt.runtime_context import get_parallel

    group = model.pp_group
    stage = dict(pp_group=group, pp_size=group.world_size, pp_rank=group.rank_in_group)
    with torch.no_grad(), get_parallel().override(**stage):
        return model.forward(input_ids=None, positions=positions,
                             forward_batch=forward_batch, inputs_embeds=embeds,
                             pp_proxy_tensors=pp_proxy_tensors)


def _stages(module):
    return (_lm(module, end_layer=SPLIT).model, _lm(module, start_layer=SPLIT).model)


def _received(proxy):
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    return PPProxyTensors({k: v.clone() for k, v in proxy.tensors.items()})


def _peaks(module, embeds, monkeypatch):
    """(first stage: all its forward allocates; last stage: held + pack, as ``_peak``;
    last stage: all its forward and the pack allocate) of one model file."""
    import torch

    from harness.memory.tracker import make_tracker
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    monkeypatch.setattr(module, "BumpAllocator", _NoBump)
    first, last = _stages(module)
    positions = torch.arange(embeds.shape[0])
    # The forward's inputs exist before it runs: the tracker's baseline.
    source, batch = embeds.clone(), _batch()
    with make_tracker("cpu") as tracker:
        proxy = _forward(first, source, positions, batch)
    first_stage = int(tracker.peak_bytes)
    assert isinstance(proxy.tensors.get("dspark_hidden_states"), torch.Tensor)
    received = _received(proxy)
    del proxy

    _, aux = _forward(last, None, positions, _batch(), _received(received))
    handed_over = capture_path_bytes(aux)
    del aux

    inherited, batch = _received(received), _batch()
    with make_tracker("cpu") as tracker:
        _, aux = _forward(last, None, positions, batch, inherited)
        packed = pack_aux_hidden_states(aux)
    del aux, packed
    return first_stage, handed_over, int(tracker.peak_bytes)


@GUARD
@pytest.mark.parametrize("tokens", [1, 96])
def test_goes_from_twice_to_once_the_captures_on_each_stage(sglang_tp1, monkeypatch,
                                                            tokens):
    import torch

    from harness.memory.models import pin_module
    from sglang.srt.models import kimi_k3

    embeds = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
    s = tokens * HIDDEN * embeds.element_size()
    k = len(IDS)
    pin = _peaks(pin_module("kimi_k3"), embeds, monkeypatch)
    patched = _peaks(kimi_k3, embeds, monkeypatch)
    assert pin == (2 * K1 * s, 2 * k * s, (k - K1 + k) * s), (pin, s)
    assert patched == (K1 * s, k * s, k * s), (patched, s)


def _after(embeds, layer_id):
    return embeds + float(sum(range(1, layer_id + 2)))


@GUARD
def test_width_and_decode_graph_buffer_reuse_per_stage(sglang_tp1):
    """What the model runner reads to size each stage's DFlash-family decode graph
    buffer, and that each stage fills a slice of it in place: the first sends it on,
    the last returns it, the received captures in its first slots."""
    import torch

    from sglang.srt.model_executor.model_runner_components.misc_utils import (
        resolve_aux_hidden_states_width,
    )
    from sglang.srt.models import kimi_k3

    dspark = types.SimpleNamespace(is_dflash_family=lambda: True)

    def width(lm, draft=False):
        return resolve_aux_hidden_states_width(model=lm, spec_algorithm=dspark,
                                               is_draft_worker=draft)

    first, last = _lm(kimi_k3, end_layer=SPLIT), _lm(kimi_k3, start_layer=SPLIT)
    assert width(_lm(kimi_k3, end_layer=SPLIT, ids=None)) == 0
    assert width(first) == K1 * HIDDEN and width(last) == len(IDS) * HIDDEN
    assert width(first, draft=True) == 0 and width(last, draft=True) == 0
    # The last stage's proxy of the earlier ones' captures, as the runner sizes it.
    assert last.get_pp_proxy_dspark_hidden_size() == K1 * HIDDEN

    tokens = 7
    embeds = torch.randn(tokens, HIDDEN)
    positions = torch.arange(tokens)
    buffers = [torch.full((tokens + 5, width(lm)), float("nan")) for lm in (first, last)]
    proxy = _forward(first.model, embeds.clone(), positions, _batch(buffers[0][:tokens]))
    sent = proxy["dspark_hidden_states"]
    assert sent.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()
    _, aux = _forward(last.model, None, positions, _batch(buffers[1][:tokens]),
                      _received(proxy))
    assert aux.untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()
    torch.testing.assert_close(buffers[1][:tokens],
                               torch.cat([_after(embeds, i) for i in IDS], dim=-1))
    for buffer in buffers:
        assert torch.isnan(buffer[tokens:]).all(), "wrote past the batch's slice"
