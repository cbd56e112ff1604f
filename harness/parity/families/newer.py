"""Families that only 0.5.23 captures in (the pin's model files have no capture setter):
Laguna (laguna.py, poolside's Laguna-XS.2), against transformers' ``LagunaForCausalLM``.

Each has a DFlash setter only (``set_dflash_layers_to_capture``): the model runner
refuses EAGLE3 for it, as the tier checks.
"""

from __future__ import annotations

from harness.parity.families import LONG_WINDOW, Family, tiny_fields

NEWEST = ("0.5.23",)


def _laguna():
    n = 4
    return tiny_fields(
        num_hidden_layers=n,
        # Laguna-XS.2's schedule shapes: full and sliding attention alternating, each
        # with its own rope parameters and head count; layer 0 dense, the rest MoE
        # (LagunaConfig's default mlp_layer_types); per-head softplus output gates.
        layer_types=["full_attention" if i % 2 == 0 else "sliding_attention"
                     for i in range(n)],
        num_attention_heads_per_layer=[4 if i % 2 == 0 else 8 for i in range(n)],
        # Longer than every sequence (LONG_WINDOW): the sliding layers' masking is left
        # out, so the captures are checked on their own.
        sliding_window=LONG_WINDOW,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0},
        },
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        gating="per-head",
        moe_routed_scaling_factor=2.0,
    )


FAMILIES = [
    Family(
        name="laguna",
        sglang_file="laguna.py",
        hf_config_class="LagunaConfig",
        hf_model_class="LagunaForCausalLM",
        config=_laguna,
        spec="laguna",
        # The FFN's sum is owed past ffn_boundary.finish and completed at the next
        # layer's attn_boundary.prepare (0.5.23's layer boundaries).
        defers=True,
        bases=NEWEST,
        eagle3=False,
    ),
]
