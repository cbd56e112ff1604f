"""DeepSeek: ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM`` (deepseek_v2.py; also
Kimi K2.x through kimi_k25's wrapper)."""

from __future__ import annotations

from harness.parity.families import IDLE_MOE, MLA_LATENT, Family, tiny_fields

# SGLang's CPU rotary path for MLA takes DeepSeek's yarn only
# (layers/rotary_embedding/factory.py): yarn with factor 1.0 is plain RoPE.
_YARN = {"rope_type": "yarn", "factor": 1.0, "rope_theta": 10000.0,
         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0}


def _v3():
    return tiny_fields(
        num_hidden_layers=5,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        **MLA_LATENT,
        v_head_dim=16,
        rope_parameters=dict(_YARN),
    )


FAMILIES = [
    Family(
        name="deepseek_v3",
        sglang_file="deepseek_v2.py",
        hf_config_class="DeepseekV3Config",
        hf_model_class="DeepseekV3ForCausalLM",
        config=_v3,
        spec="deepseek_v2",
        defers=True,
        attention="triton",
        # Fields real DeepSeek-V3 configs carry that SGLang reads and transformers 5
        # does not write.
        config_json={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                     "rope_theta": 10000.0, "rope_scaling": dict(_YARN)},
        cannot_run=IDLE_MOE,
    ),
]
