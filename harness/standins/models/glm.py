"""GLM family: ``Glm4Model`` (glm4.py), ``Glm4MoeModel`` (glm4_moe.py) and
``Glm4MoeLiteModel`` (glm4_moe_lite.py).

All three capture at the top of the layer loop (``hidden_states + residual``, in a
list). glm4 is dense, has no LayerCommunicator and never defers; it has no capture
setter at the pin (the capture path is dead code), so its spec drives captures by
setting ``layers_to_capture`` directly. glm4_moe and glm4_moe_lite use the
LayerCommunicator and defer the MLP/MoE all-reduce into the next layer's fused norm;
their tiny configs have one dense layer (``first_k_dense_replace=1``) and seven MoE
layers, so both the dense MLP and the MoE block run.
"""

from __future__ import annotations

from harness.standins.models import (
    REDUCE_DEFERABLE,
    REDUCE_NONE,
    REDUCE_SELF,
    ModelSpec,
    hf_config,
)

# One dense layer (layer 0), the rest MoE: both MLP paths run, and the dense layer
# defers into layer 1's fused norm too (it is not the last layer).
_FIRST_K_DENSE = 1


def _glm4_config(tc):
    from transformers import Glm4Config

    return hf_config(tc, Glm4Config, partial_rotary_factor=0.5, attention_bias=True)


def _glm4_moe_config(tc):
    from transformers import Glm4MoeConfig

    return hf_config(
        tc,
        Glm4MoeConfig,
        partial_rotary_factor=0.5,
        moe_intermediate_size=tc.intermediate_size,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        first_k_dense_replace=_FIRST_K_DENSE,
        use_qk_norm=False,
    )


def _glm4_moe_lite_config(tc):
    from transformers import Glm4MoeLiteConfig

    return hf_config(
        tc,
        Glm4MoeLiteConfig,
        architectures=["Glm4MoeLiteForCausalLM"],
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        moe_intermediate_size=tc.intermediate_size,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        first_k_dense_replace=_FIRST_K_DENSE,
        # Glm4MoeLiteForCausalLM.__init__ forces this (glm4_moe_lite.py:908); the
        # model class alone does not, and _is_layer_sparse reads it.
        moe_layer_freq=1,
    )


def _run_lite(model, input_ids, positions, forward_batch):
    # As Glm4MoeLiteForCausalLM.forward (glm4_moe_lite.py:980-983). A no-op here:
    # AttnTpContext.init_context (the only thing that allows input scattering) is
    # called only by DeepseekV2ForCausalLM.__init__.
    from sglang.srt.layers.communicator import get_attn_tp_context

    with get_attn_tp_context().maybe_input_scattered(forward_batch):
        return model(input_ids, positions, forward_batch)


SPECS = [
    ModelSpec(
        name="glm4",
        module="sglang.srt.models.glm4",
        model_cls="Glm4Model",
        standins={
            # o_proj: RowParallelLinear with the default reduce_results=True (glm4.py:161-167).
            "Glm4Attention": (REDUCE_SELF, {}),
            # down_proj: RowParallelLinear(reduce_results=True) (glm4.py:70, 79-86), called
            # with skip_all_reduce=use_reduce_scatter (glm4.py:104), which the layer never passes
            # (self.mlp(hidden_states), glm4.py:287).
            "Glm4MLP": (REDUCE_SELF, {}),
        },
        config=_glm4_config,
        pin_bugs=frozenset({"B", "C", "U"}),
        wraps=(
            "glm4.py: Glm4ForCausalLM (no set_eagle3/dflash setter at the pin: dead path)",
            "glm4v.py, glm_ocr.py (Glm4Model as the language model; no setter either)",
        ),
        note=(
            "No capture setter at the pin: EAGLE3 raises AttributeError, DFlash ValueError; "
            "the spec sets Glm4Model.layers_to_capture directly (the default configure). "
            "Sandwich norms (post_self_attn_layernorm, post_mlp_layernorm); h + r is the "
            "stream. Capture is None-guarded."
        ),
    ),
    ModelSpec(
        name="glm4_moe",
        module="sglang.srt.models.glm4_moe",
        model_cls="Glm4MoeModel",
        standins={
            # o_proj: RowParallelLinear(reduce_results=False) (glm4_moe.py:252);
            # the communicator's prepare_mlp all-reduces. The layer reads
            # self_attn.qkv_proj in __init__ (_detect_attn_quant_format,
            # glm4_moe.py:889, 926-928); only an aiter FP8 scheme on ROCm matters there.
            "Glm4MoeAttention": (REDUCE_NONE, {"qkv_proj": None}),
            # Dense layers: down_proj reduce_results=True with
            # skip_all_reduce=should_allreduce_fusion or use_reduce_scatter (glm4_moe.py:155, 178-180).
            "Glm4MoeMLP": (REDUCE_DEFERABLE, {}),
            # all-reduces unless should_skip_post_experts_all_reduce(..., use_reduce_scatter,
            # should_allreduce_fusion) (glm4_moe.py:612-617, 645-650).
            "Glm4MoeSparseMoeBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_glm4_moe_config,
        defers=True,
        pin_bugs=frozenset({"A", "B", "C", "R"}),
        wraps=(
            "glm4_moe.py: Glm4MoeForCausalLM (set_eagle3_layers_to_capture only)",
            "glm4v_moe.py: Glm4vMoeForConditionalGeneration (Glm4MoeModel; no setter: dead)",
        ),
        note=(
            "Auto-enabled FlashInfer fusion arch (Glm4MoeForCausalLM). Its TBO branch "
            "(glm4_moe.py:1140-1151) never runs: OperationsStrategy.init_new_tbo has no "
            "plan for Glm4MoeDecoderLayer and raises NotImplementedError for any TBO "
            "batch, capturing or not (no bug T). Unguarded hidden_states + residual: "
            "index 0 raises TypeError."
        ),
    ),
    ModelSpec(
        name="glm4_moe_lite",
        module="sglang.srt.models.glm4_moe_lite",
        model_cls="Glm4MoeLiteModel",
        standins={
            # imported into glm4_moe_lite (glm4_moe_lite.py:78); built with
            # reduce_results=False (glm4_moe_lite.py:571): the communicator all-reduces. Its
            # communicator takes qkv_latent_func=self.self_attn.prepare_qkv_latent.
            "DeepseekV2AttentionMLA": (REDUCE_NONE, {}),
            # Dense layers: skip_all_reduce=should_allreduce_fusion or use_reduce_scatter
            # (glm4_moe_lite.py:122, 145-147).
            "Glm4MoeLiteMLP": (REDUCE_DEFERABLE, {}),
            # all-reduces unless should_skip_post_experts_all_reduce (359-364, 392-397).
            "Glm4MoeLiteSparseMoeBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_glm4_moe_lite_config,
        run=_run_lite,
        defers=True,
        pin_bugs=frozenset({"A", "B", "C"}),
        wraps=(
            "glm4_moe_lite.py: Glm4MoeLiteForCausalLM (set_eagle3 and set_dflash)",
            "glm4_moe_lite_nextn.py (Glm4MoeLiteDecoderLayer only; no capture)",
        ),
        note=(
            "Auto-enabled FlashInfer fusion arch. set_eagle3_layers_to_capture maps ids "
            "+1 only when layer_ids[0] == 1, else raw (glm4_moe_lite.py:1034-1037). Its "
            "TBO branch (864-876) never runs: init_new_tbo raises NotImplementedError for "
            "Glm4MoeLiteDecoderLayer (no bug T). prepare_attn gets quant_format "
            "positionally."
        ),
    ),
]
