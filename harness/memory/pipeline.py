"""kimi_k3's capture path over two pipeline stages, pristine against the series
(0.5.23's kimi-k3-pp-aux-packer): the memory tier's test
(tests/memory/test_capture_memory_kimi_k3_0523.py) and ``bench --pp``.

kimi_k3 has no stand-in spec (MLA and KDA attention on the layer boundaries, the
attention-residual bank), so this is the memory route without one: the real
``KimiK3LinearModel.forward`` of pristine 0.5.23 (``pin_module``) and of the patched
tree, each run as two stages with its pipeline group overridden, over whole-layer
stand-ins on SGLang's real residual stream whose own compute runs with the tracker
suspended. The first stage packs ``K1`` captures, the last ``K = len(IDS)``.
"""

from __future__ import annotations

import types

from harness.memory.tracker import untracked

NUM_LAYERS = 6
SPLIT = 3  # the first stage runs layers 0-2, the last 3-5
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


def lm(module, start_layer=0, end_layer=NUM_LAYERS, ids=IDS, hidden=16):
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
    model.config = types.SimpleNamespace(hidden_size=hidden)
    lm = module.KimiK3LinearForCausalLM.__new__(module.KimiK3LinearForCausalLM)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = model.config
    lm.capture_aux_hidden_states = False
    if ids is not None:
        lm.set_dspark_layers_to_capture(list(ids))
    return lm


def batch(buffer=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(can_run_tbo=False, residual_stream=None,
                                 forward_mode=ForwardMode.EXTEND,
                                 aux_hidden_states_buffer=buffer)


def forward(model, embeds, positions, forward_batch, pp_proxy_tensors=None):
    import torch

    from sglang.srt.runtime_context import get_parallel

    group = model.pp_group
    stage = dict(pp_group=group, pp_size=group.world_size, pp_rank=group.rank_in_group)
    with torch.no_grad(), get_parallel().override(**stage):
        return model.forward(input_ids=None, positions=positions,
                             forward_batch=forward_batch, inputs_embeds=embeds,
                             pp_proxy_tensors=pp_proxy_tensors)


def stages(module, hidden=16):
    return (lm(module, end_layer=SPLIT, hidden=hidden).model,
            lm(module, start_layer=SPLIT, hidden=hidden).model)


def received(proxy):
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    return PPProxyTensors({k: v.clone() for k, v in proxy.tensors.items()})


def stage_peaks(module, embeds) -> tuple[int, int, int]:
    """(first stage: all its forward allocates; last stage: the captures it hands over
    plus the pack, as ``harness.memory.models._peak``; last stage: all its forward and
    the pack allocate) of one model file, in bytes."""
    allocator = module.BumpAllocator
    module.BumpAllocator = _NoBump
    try:
        return _stage_peaks(module, embeds)
    finally:
        module.BumpAllocator = allocator


def _stage_peaks(module, embeds):
    import torch

    from harness.memory.models import capture_path_bytes, pack_for_draft
    from harness.memory.tracker import make_tracker

    first, last = stages(module, hidden=embeds.shape[-1])
    positions = torch.arange(embeds.shape[0])
    # The forward's inputs exist before it runs: the tracker's baseline.
    source, fb = embeds.clone(), batch()
    with make_tracker("cpu") as tracker:
        proxy = forward(first, source, positions, fb)
    first_stage = int(tracker.peak_bytes)
    assert isinstance(proxy.tensors.get("dspark_hidden_states"), torch.Tensor)
    sent = received(proxy)
    del proxy

    _, aux = forward(last, None, positions, batch(), received(sent))
    handed_over = capture_path_bytes(aux)
    del aux

    inherited, fb = received(sent), batch()
    with make_tracker("cpu") as tracker:
        _, aux = forward(last, None, positions, fb, inherited)
        packed = pack_for_draft(aux)
    del aux, packed
    return first_stage, handed_over, int(tracker.peak_bytes)


def kimi_k3_pp_peaks(tokens: int, hidden: int, dtype: str = "bfloat16") -> dict:
    """Side by side in one process: the three stage peaks (``stage_peaks``) of
    pristine 0.5.23's kimi_k3 and of the series', for ``tokens`` x ``hidden``."""
    import torch

    from harness.memory.models import pin_module
    from sglang.srt.models import kimi_k3

    embeds = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype))
    s = tokens * hidden * embeds.element_size()
    keys = ("first_stage_forward", "last_stage_capture_path", "last_stage_forward_and_pack")
    out = {"tokens": tokens, "hidden": hidden, "dtype": dtype, "k1": K1, "k": len(IDS),
           "capture_bytes": s}
    for variant, module in (("pin", pin_module("kimi_k3")), ("patched", kimi_k3)):
        out[variant] = dict(zip(keys, stage_peaks(module, embeds)))
    return out
