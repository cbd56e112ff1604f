"""Kimi Linear packs its DSpark captures on every pipeline stage (0.5.23's
kimi-linear-pp-aux-packer, the fork's; issue 28, PP).

kimi-linear-aux-packer packs without pipeline parallelism only, in upstream's shape
(``packs_aux_hidden_states``, as kimi_k3's): a pipeline stage keeps the plain list, the
one that is not the last concatenates it into ``pp_proxy_tensors["dspark_hidden_states"]``
and the last appends that block to its own list. This patch packs on every stage: the
first sends one packed buffer, the last puts it in its first slots and returns one packed
tensor, and each stage reports its own width. Checked on the real
``KimiLinearModel.forward`` of the tree, run as two stages with the pipeline group
overridden, over stand-in layers on SGLang's real residual stream (each adds
``layer_id + 1``), against the layer outputs.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("kimi-linear-pp-aux-packer")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
IDS = [0, 1, NUM_LAYERS - 1]  # the first stage (layers 0-1) captures two, the last one
SPLIT = 2


def _model(start_layer, end_layer):
    import torch
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
    from sglang.srt.models.kimi_linear import KimiLinearModel
    from torch import nn

    from harness.suites.models import bare

    class FromPP:
        def from_pp(self, pp_proxy_tensors, forward_batch):
            residual_batch.start(forward_batch)
            return pp_proxy_tensors["hidden_states"]

    class Layer(nn.Module):
        def __init__(self, layer_id):
            super().__init__()
            self.layer_id = layer_id
            self.attn_boundary = FromPP()

        def forward(self, positions, hidden_states, forward_batch, zero_allocator):
            hidden_states = residual_batch.fold(hidden_states, forward_batch)
            added = torch.full_like(hidden_states, float(self.layer_id + 1))
            return residual_batch.stream_of(forward_batch).record(added, PLAIN_ADD)

    class Norm(nn.Module):
        """Fused add + RMSNorm: updates its inputs in place, as the GPU kernel does."""

        def forward(self, hidden_states, residual=None, **unused):
            if residual is None:
                return hidden_states.mul_(0.5)
            residual.add_(hidden_states)
            hidden_states.copy_(residual * 0.5)
            return hidden_states, residual

    model = bare(KimiLinearModel, start_layer=start_layer, end_layer=end_layer,
                 dspark_layers_to_capture=list(IDS), norm=Norm(),
                 config=types.SimpleNamespace(hidden_size=HIDDEN),
                 pp_group=types.SimpleNamespace(is_first_rank=start_layer == 0,
                                                is_last_rank=end_layer == NUM_LAYERS,
                                                world_size=2, rank_in_group=int(start_layer > 0)))
    model.layers = nn.ModuleList([Layer(i) for i in range(NUM_LAYERS)])
    return model


def _forward(model, embeds, pp_proxy_tensors=None):
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel

    batch = types.SimpleNamespace(can_run_tbo=False, residual_stream=None,
                                  forward_mode=ForwardMode.EXTEND, aux_hidden_states_buffer=None)
    group = model.pp_group
    with get_parallel().override(pp_group=group, pp_size=group.world_size, pp_rank=group.rank_in_group):
        return model.forward(input_ids=None, positions=torch.arange(TOKENS), forward_batch=batch,
                             inputs_embeds=embeds, pp_proxy_tensors=pp_proxy_tensors)


def _after(embeds, layer_id):
    return embeds + float(sum(range(1, layer_id + 2)))


@GUARD
def test_stages_send_and_return_one_packed_buffer():
    import torch
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    embeds = torch.randint(-8, 8, (TOKENS, HIDDEN)).float()  # sums exact in float32
    proxy = _forward(_model(0, SPLIT), embeds.clone())
    sent = proxy["dspark_hidden_states"]
    first = torch.cat([_after(embeds, i) for i in IDS[:2]], dim=-1)
    assert torch.equal(sent, first)
    received = PPProxyTensors({"hidden_states": proxy["hidden_states"] + proxy.tensors.get("residual", 0),
                               "dspark_hidden_states": sent})
    _, aux = _forward(_model(SPLIT, NUM_LAYERS), torch.empty(0, HIDDEN), received)
    assert isinstance(aux, torch.Tensor), f"the last stage handed on a {type(aux).__name__}"
    assert torch.equal(aux, torch.cat([_after(embeds, i) for i in IDS], dim=-1))
    assert pack_aux_hidden_states(aux) is aux


@GUARD
@pytest.mark.parametrize("stage,width", [((0, SPLIT), 2 * HIDDEN), ((SPLIT, NUM_LAYERS), 3 * HIDDEN)],
                         ids=["first", "last"])
def test_each_stage_reports_its_packed_width(stage, width):
    from sglang.srt.models.kimi_linear import KimiLinearForCausalLM

    from harness.suites.models import bare

    lm = bare(KimiLinearForCausalLM, model=_model(*stage),
              config=types.SimpleNamespace(hidden_size=HIDDEN), capture_aux_hidden_states=True)
    assert lm.get_aux_hidden_states_width() == width
