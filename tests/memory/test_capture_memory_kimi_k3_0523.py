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

from harness.memory.pipeline import IDS, K1, SPLIT, batch, forward, received, stage_peaks
from harness.memory.pipeline import lm as causal_lm

pytestmark = pytest.mark.bases("0.5.23")

GUARD = pytest.mark.guards("kimi-k3-pp-aux-packer")
HIDDEN = 16


@GUARD
@pytest.mark.parametrize("tokens", [1, 96])
def test_goes_from_twice_to_once_the_captures_on_each_stage(sglang_tp1, tokens):
    import torch

    from harness.memory.models import pin_module
    from sglang.srt.models import kimi_k3

    embeds = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
    s = tokens * HIDDEN * embeds.element_size()
    k = len(IDS)
    pin = stage_peaks(pin_module("kimi_k3"), embeds)
    patched = stage_peaks(kimi_k3, embeds)
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

    first = causal_lm(kimi_k3, end_layer=SPLIT, hidden=HIDDEN)
    last = causal_lm(kimi_k3, start_layer=SPLIT, hidden=HIDDEN)
    assert width(causal_lm(kimi_k3, end_layer=SPLIT, ids=None, hidden=HIDDEN)) == 0
    assert width(first) == K1 * HIDDEN and width(last) == len(IDS) * HIDDEN
    assert width(first, draft=True) == 0 and width(last, draft=True) == 0
    # The last stage's proxy of the earlier ones' captures, as the runner sizes it.
    assert last.get_pp_proxy_dspark_hidden_size() == K1 * HIDDEN

    tokens = 7
    embeds = torch.randn(tokens, HIDDEN)
    positions = torch.arange(tokens)
    buffers = [torch.full((tokens + 5, width(lm)), float("nan")) for lm in (first, last)]
    proxy = forward(first.model, embeds.clone(), positions, batch(buffers[0][:tokens]))
    sent = proxy["dspark_hidden_states"]
    assert sent.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()
    _, aux = forward(last.model, None, positions, batch(buffers[1][:tokens]),
                      received(proxy))
    assert aux.untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()
    torch.testing.assert_close(buffers[1][:tokens],
                               torch.cat([_after(embeds, i) for i in IDS], dim=-1))
    for buffer in buffers:
        assert torch.isnan(buffer[tokens:]).all(), "wrote past the batch's slice"
