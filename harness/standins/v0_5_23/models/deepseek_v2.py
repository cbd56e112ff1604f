"""DeepSeek-V2/V3/R1, Kimi K2.x on 0.5.23: ``DeepseekV2Model`` (deepseek_v2.py).

The pin's DeepSeek matrix (``harness.standins.deepseek_v2``, ``harness.suites.capture``)
drives the pin's ``LayerCommunicator``, which 0.5.23 no longer has; on this base the
model runs in the generic model matrix (``in_matrix=True``).
"""

from __future__ import annotations

import dataclasses

from harness.standins.blocks import TinyConfig
from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_scattered,
    standin_class,
)
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.deepseek_v2 import _config

# Two dense-by-position layers first, then MoE layers (the pin's config): two-batch
# overlap runs layers [2, 8), which SGLang's TBO plan takes only when they are sparse.
_TINY = dataclasses.replace(TinyConfig(), first_k_dense_replace=2)


def _build_patches(mod):
    return [
        (mod, "DeepseekV2AttentionMLA", mla_standin(mod.DeepseekV2AttentionMLA, _TINY)),
        # DeepseekV2MLP(reduce_results=False, allow_fused_down=False) (2665-2675): the
        # layer's ffn_boundary.exit(...).finish defers or completes the sum.
        (mod, "DeepseekV2MLP", standin_class(mod.DeepseekV2MLP, _TINY, {})),
        # The sparse layers' MoE: its partial sum, which the ffn boundary completes.
        (mod, "DeepseekV2MoE", standin_class(mod.DeepseekV2MoE, _TINY, {})),
    ]


SPECS = [
    ModelSpec(
        name="deepseek_v2",
        module="sglang.srt.models.deepseek_v2",
        model_cls="DeepseekV2Model",
        standins={},
        build_patches=_build_patches,
        config=_config,
        defers=True,
        # 0.5.23: captures through attn_boundary.prepare(capture_gathered=packer),
        # after the owed sum (no A); packs (no B); the last layer is never captured and
        # AuxHiddenStatePacker.finalize() raises "captured K-1 of K" (C); two-batch
        # overlap runs layers >= first_k_dense_replace without captures (T: raise); the
        # packer is AuxHiddenStatePacker(len(layers_to_capture)), never for_batch, and
        # the CausalLM reports no width (G: no DFlash decode graph's shared buffer).
        pin_bugs=frozenset({"C", "T", "G"}),
        fixed_by={"C": "dsv2-capture-final-layer", "G": "dsv2-mimo-aux-packer-shared"},
        layer_output=layer_output,
        run=run_scattered,
        tiny=_TINY,
        in_matrix=True,
        wraps=("deepseek_v2.py: DeepseekV2/V3/V32ForCausalLM", "kimi_k25.py (language model)",
               "glm4_moe.py: GlmMoeDsaForCausalLM (subclass)"),
    ),
]
