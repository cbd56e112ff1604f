"""Kimi Linear on 0.5.23: ``KimiLinearModel`` (kimi_linear.py, Kimi-Linear-48B-A3B).

Each decoder layer (``KimiDecoderLayer``) is an attention stage and an FFN stage on the
layer boundaries. The attention is, per ``config.is_kda_layer``, a KDA linear attention
(``KimiDeltaAttention``, o_proj ``reduce_results=False``) or DeepSeek's MLA (imported as
``KimiMLAAttention``, ``reduce_results=False``); the FFN is, per
``first_k_dense_replace`` / ``moe_layer_freq``, llama's MLP (imported as ``KimiMLP``) or
``KimiMoE`` (routed and shared experts, ``reduce_results=False``): the boundaries own
every sum, so every stand-in is REDUCE_NONE. The stand-ins are GLM-5-Next's (same KDA /
MLA split, :mod:`.glm5_next`). The tiny config keeps the checkpoint's schedule shapes:
KDA layers with an MLA layer every fourth (``linear_attn_config``: ``kda_layers`` and
``full_attn_layers``, 1-based), the first layer dense, then MoE.

Captures: DSpark only (``set_dspark_layers_to_capture``: ids are layer outputs). After
layer ``i`` for ``i in dspark_layers_to_capture``, a ``residual_batch.snapshot`` of the
stream (the function :func:`layer_output` uses, at the same point, as longcat_flash:
the reference is independent only of the TP > 1 completion, taken at TP = 1); the last
layer's in the loop, or (``post_norm``, final-layer-capture) the final norm's output.
The spec sets ``dspark_layers_to_capture`` (capture index ``i`` = id ``i - 1``).
"""

from __future__ import annotations

import dataclasses

from harness.standins.blocks import TinyConfig
from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_plain,
    standin_class,
)

# The checkpoint's first layer is dense (first_k_dense_replace=1), the rest MoE.
_TINY = dataclasses.replace(TinyConfig(), first_k_dense_replace=1)


def _kimi_linear_config(tc):
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    n = tc.num_layers
    return hf_config(
        tc,
        KimiLinearConfig,
        # Kimi-Linear-48B-A3B: 3 KDA layers to 1 MLA layer (1-based ids).
        linear_attn_config={
            "kda_layers": [i + 1 for i in range(n) if i % 4 != 3],
            "full_attn_layers": [i + 1 for i in range(n) if i % 4 == 3],
            "head_dim": 4,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        mla_use_nope=True,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=tc.intermediate_size,
        num_shared_experts=1,
        first_k_dense_replace=tc.first_k_dense_replace,
        moe_layer_freq=1,
        num_expert_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
    )


def _build_patches(mod):
    return [
        # MLA layers: deepseek_v2's DeepseekV2AttentionMLA (kimi_linear.py 53), built
        # with reduce_results=False and skip_rope=True.
        (mod, "KimiMLAAttention", mla_standin(mod.KimiMLAAttention, _TINY)),
        # KDA layers: reduce_results=False; attn_boundary.finish declares the sum.
        (mod, "KimiDeltaAttention", standin_class(mod.KimiDeltaAttention, _TINY, {})),
        # The dense layer's MLP (llama's LlamaMLP) and the MoE (routed experts and the
        # shared experts' KimiMLP), reduce_results=False: ffn_boundary.finish's sum.
        (mod, "KimiMLP", standin_class(mod.KimiMLP, _TINY, {})),
        (mod, "KimiMoE", standin_class(mod.KimiMoE, _TINY, {})),
    ]


def _configure(model, indices):
    """What ``KimiLinearForCausalLM.set_dspark_layers_to_capture`` leaves on the model
    for capture indices ``indices``: the layer-output ids ``i - 1`` (None: no capture)."""
    if any(i < 1 for i in indices):
        raise ValueError(f"kimi_linear captures layer outputs: no capture index {list(indices)}")
    model.dspark_layers_to_capture = [i - 1 for i in indices] if indices else None


SPECS = [
    ModelSpec(
        name="kimi_linear",
        module="sglang.srt.models.kimi_linear",
        model_cls="KimiLinearModel",
        standins={},
        build_patches=_build_patches,
        config=_kimi_linear_config,
        configure=_configure,
        # The FFN sum is owed past ffn_boundary.finish and completed at the next
        # layer's attn_boundary.prepare (or the final norm) at TP > 1.
        defers=True,
        # B: list + cat. DSpark only (no EAGLE3 or DFlash setter; the model runner
        # refuses EAGLE3 and plain DFlash with one error): not fixed by the series.
        pin_bugs=frozenset({"B", "U"}),
        fixed_by={"B": "kimi-linear-aux-packer", "U": None},
        layer_output=layer_output,
        run=run_plain,
        tiny=_TINY,
        wraps=("kimi_linear.py: KimiLinearForCausalLM (set_dspark_layers_to_capture only)",),
        note="residual_batch.snapshot after layer i for i in dspark_layers_to_capture "
        "(pristine kimi_linear.py 740-747); the last layer's in the loop (pre_norm) or "
        "after the final norm (post_norm, final-layer-capture): K of K. Layers 3 and 7 "
        "MLA, the rest KDA; layer 0 dense, the rest MoE. PP: earlier stages' captures "
        "arrive in pp_proxy_tensors['dspark_hidden_states'] (template only).",
    ),
]
