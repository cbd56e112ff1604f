"""DeepSeek-V2/V3/R1, Kimi K2.x: ``DeepseekV2Model`` (deepseek_v2.py), as a model spec.

The capture matrix for this model lives in tests/multirank/test_capture_matrix.py
(:mod:`harness.standins.deepseek_v2`, with list collectors and attention-TP input
scattering); this spec puts it in the per-model checks too (packed output, idle batch,
fullgraph trace, two-batch overlap) and not in the generic multirank matrix
(``in_matrix=False``). Its fixes are patches 0002-0004, so ``fixed_by`` names them.
"""

from __future__ import annotations

import dataclasses

from harness.standins.blocks import TinyConfig
from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, ModelSpec

# Two dense-by-position layers first, then MoE layers: two-batch overlap runs layers
# [2, 8), which SGLang's TBO plan takes only when they are sparse (DeepseekV2MoE).
_TINY = dataclasses.replace(TinyConfig(), first_k_dense_replace=2)


def _config(tc):
    from harness.standins.deepseek_v2 import make_config

    config = make_config(tc)
    # DeepSeek-V3's layout: MoE from first_k_dense_replace on (DeepseekV2MoE stands in).
    config.n_routed_experts = 4
    config.num_experts_per_tok = 2
    config.n_shared_experts = 1
    config.n_group = 1
    config.topk_group = 1
    config.routed_scaling_factor = 1.0
    config.norm_topk_prob = True
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def _run(model, input_ids, positions, forward_batch):
    # As DeepseekV2ForCausalLM.forward: attention-TP input scattering decided per batch.
    from sglang.srt.layers.communicator import get_attn_tp_context

    with get_attn_tp_context().maybe_input_scattered(forward_batch):
        return model(input_ids, positions, forward_batch)


SPECS = [
    ModelSpec(
        name="deepseek_v2",
        module="sglang.srt.models.deepseek_v2",
        model_cls="DeepseekV2Model",
        standins={
            # reduce_results=False (deepseek_v2.py:1979): prepare_mlp all-reduces.
            "DeepseekV2AttentionMLA": (REDUCE_NONE, {}),
            # down_proj(skip_all_reduce=should_allreduce_fusion or use_reduce_scatter).
            "DeepseekV2MLP": (REDUCE_DEFERABLE, {}),
            # The sparse layers' MoE: all-reduces its routed + shared output unless the
            # layer defers it (should_allreduce_fusion / use_reduce_scatter).
            "DeepseekV2MoE": (REDUCE_DEFERABLE, {}),
        },
        config=_config,
        defers=True,
        pin_bugs=frozenset({"A", "B", "C", "T"}),
        fixed_by={"A": "dsv2-capture-after-allreduce", "B": "aux-packer",
                  "C": "dsv2-capture-final-layer"},
        run=_run,
        tiny=_TINY,
        in_matrix=False,
        wraps=("deepseek_v2.py: DeepseekV2/V3/V32ForCausalLM", "kimi_k25.py (language model)",
               "glm4_moe.py: GlmMoeDsaForCausalLM (subclass)"),
    ),
]
