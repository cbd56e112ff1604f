"""Qwen: qwen2.py, qwen3.py, qwen2_moe.py, qwen3_moe.py."""

from __future__ import annotations

from harness.parity.families import IDLE_MOE, IDLE_ROPE, Family, tiny_fields


def _moe(**fields):
    return tiny_fields(
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        **fields,
    )


FAMILIES = [
    Family(
        name="qwen2",
        sglang_file="qwen2.py",
        hf_config_class="Qwen2Config",
        hf_model_class="Qwen2ForCausalLM",
        config=lambda: tiny_fields(),
        spec="qwen2",
        cannot_run=IDLE_ROPE,
    ),
    Family(
        name="qwen3",
        sglang_file="qwen3.py",
        hf_config_class="Qwen3Config",
        hf_model_class="Qwen3ForCausalLM",
        config=lambda: tiny_fields(),
        spec="qwen3",
    ),
    Family(
        name="qwen2_moe",
        sglang_file="qwen2_moe.py",
        hf_config_class="Qwen2MoeConfig",
        hf_model_class="Qwen2MoeForCausalLM",
        config=lambda: _moe(shared_expert_intermediate_size=48),
        spec="qwen2_moe",
        cannot_run=IDLE_MOE,
    ),
    Family(
        name="qwen3_moe",
        sglang_file="qwen3_moe.py",
        hf_config_class="Qwen3MoeConfig",
        hf_model_class="Qwen3MoeForCausalLM",
        config=lambda: _moe(),
        spec="qwen3_moe",
        defers=True,
        cannot_run=IDLE_MOE,
    ),
]
