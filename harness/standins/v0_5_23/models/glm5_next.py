"""GLM-5-Next on 0.5.23: ``Glm5NextModel`` (glm5_next.py).

Each decoder layer is an attention stage and an FFN stage on the layer boundaries. The
attention is, per ``config.is_kda_layer``, a KDA linear attention
(``Glm5NextLinearAttention``, o_proj ``reduce_results=False``) or DeepSeek's MLA
(``DeepseekV2AttentionMLA``, ``reduce_results=False``); the FFN is, per
``first_k_dense_replace`` / ``moe_layer_freq``, DeepSeek's dense MLP or MoE (imported as
``Glm5NextMLP`` / ``Glm5NextMoE``, both ``reduce_results=False``): the boundaries own
every sum, so every stand-in is REDUCE_NONE. The tiny config keeps the checkpoint's
schedule shapes: KDA layers with a full-attention (MLA) layer every fourth
(``Glm5NextTextConfig``'s default ``kda_layers``), two dense layers, then MoE.

Captures: the ``capture_output`` closure at ``attn_boundary.prepare`` of layer ``i`` for
``i in layers_to_capture`` (it contracts mHC streams under DFlash, and all-gathers over
attention TP under an all-to-all MoE backend; neither applies here: ``mhc=False``, no
a2a backend), and, with the series' ``models-capture-final-layer``, the last layer's
output through ``residual_batch.final_norm(capture=)``.
"""

from __future__ import annotations

import dataclasses

from harness.standins.blocks import TinyConfig
from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_scattered,
    standin_class,
)

# Two dense layers first, then MoE layers (the checkpoint has three dense ones).
_TINY = dataclasses.replace(TinyConfig(), first_k_dense_replace=2)


def _glm5_next_config(tc):
    from sglang.srt.configs.glm5_next import Glm5NextTextConfig

    return hf_config(
        tc,
        Glm5NextTextConfig,
        # linear_attn_config left to Glm5NextTextConfig: KDA layers except every
        # fourth (i % 4 == 3), which is MLA.
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        linear_head_dim=4,
        linear_num_heads=4,
        moe_intermediate_size=tc.intermediate_size,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=tc.first_k_dense_replace,
        moe_layer_freq=1,
        mhc=False,
    )


def _build_patches(mod):
    return [
        # Full-attention layers: imported from deepseek_v2 (glm5_next.py 103), built
        # with reduce_results=False; its qkv_latent_func is prepare_qkv_latent.
        (mod, "DeepseekV2AttentionMLA", mla_standin(mod.DeepseekV2AttentionMLA, _TINY)),
        # KDA layers: reduce_results=False; attn_boundary.finish declares the sum
        # (SumGroup.TP or ATTN_TP per linear_attn_parallel_group()).
        (mod, "Glm5NextLinearAttention",
         standin_class(mod.Glm5NextLinearAttention, _TINY, {})),
        # DeepseekV2MLP / DeepseekV2MoE under glm5_next's names, reduce_results=False:
        # the sum is ffn_boundary.finish's.
        (mod, "Glm5NextMLP", standin_class(mod.Glm5NextMLP, _TINY, {})),
        (mod, "Glm5NextMoE", standin_class(mod.Glm5NextMoE, _TINY, {})),
    ]


SPECS = [
    ModelSpec(
        name="glm5_next",
        module="sglang.srt.models.glm5_next",
        model_cls="Glm5NextModel",
        standins={},
        build_patches=_build_patches,
        config=_glm5_next_config,
        # The FFN sum is owed past ffn_boundary.finish and completed at the next
        # layer's attn_boundary.prepare (or the final norm) at TP > 1.
        defers=True,
        # B: list + cat; C: the final norm took no capture (K-1 of K). Two-batch
        # overlap was gated on DFlash only, but init_new_tbo refuses
        # Glm5NextDecoderLayer, capturing or not: latent, not a bug letter here.
        pin_bugs=frozenset({"B", "C"}),
        fixed_by={"B": "glm5-next-aux-packer"},
        layer_output=layer_output,
        # As Glm5NextForConditionalGeneration.forward (maybe_input_scattered).
        run=run_scattered,
        tiny=_TINY,
        wraps=(
            "glm5_next.py: Glm5NextForConditionalGeneration (set_eagle3 and "
            "set_dflash; its language model)",
        ),
        note="capture_output closure at attn_boundary.prepare of layer i "
        "(glm5_next.py 1191-1210); the last layer at final_norm(capture=) with "
        "models-capture-final-layer. mhc=False: under DFlash + mHC the closure "
        "contracts the hc_mult streams (hc_contract), not built here.",
    ),
]
