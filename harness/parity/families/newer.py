"""Families that only 0.5.23 captures in (the pin's model files have no capture setter):
Laguna (laguna.py, poolside's Laguna-XS.2) and NemotronH (nemotron_h.py: Mamba2, attention
and MLP layers, one mixer or FFN each), against transformers' ``LagunaForCausalLM`` and
``NemotronHForCausalLM``.

Each has a DFlash setter only (``set_dflash_layers_to_capture``): the model runner
refuses EAGLE3 for it, as the tier checks.
"""

from __future__ import annotations

from harness.parity.families import LONG_WINDOW, Family, tiny_fields
from harness.parity.families.granitemoehybrid import _CANNOT_RUN as _MAMBA2_CANNOT_RUN

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


# NemotronH's layer kinds, as released checkpoints name them ("M*M-": Mamba2, attention,
# Mamba2, MLP). transformers >= 5.15 writes "linear_attention" / "full_attention" (and
# its MTP kinds likewise), which SGLang's NemotronHConfig refuses, so config.json holds
# the released names.
_NEMOTRON_H_LAYERS = ["mamba", "attention", "mamba", "mlp"]


def _nemotron_h():
    fields = tiny_fields(
        num_hidden_layers=len(_NEMOTRON_H_LAYERS),
        layers_block_type=list(_NEMOTRON_H_LAYERS),
        # Mamba2: 8 heads of 16 (expand 2 x hidden 64), one group, width-4 conv.
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        expand=2,
        chunk_size=256,
        use_conv_bias=True,
        mamba_proj_bias=False,
        layer_norm_epsilon=1e-6,
        residual_in_fp32=False,
    )
    fields.pop("rms_norm_eps")
    return fields


FAMILIES.append(
    Family(
        name="nemotron_h",
        sglang_file="nemotron_h.py",
        hf_config_class="NemotronHConfig",
        hf_model_class="NemotronHForCausalLM",
        config=_nemotron_h,
        spec="nemotron_h",
        # An FFN's sum is owed past its boundary and completed at the next stage's input.
        defers=True,
        bases=NEWEST,
        eagle3=False,
        hf_final_norm="model.norm_f",
        # SGLang's NemotronHConfig takes the mixer's group count as ``mamba_n_groups``
        # (default 8; nemotron_h.py:643 builds MambaMixer2 with it) and sizes the mamba
        # state by ``n_groups`` (configs/nemotron_h.py:430), which is what transformers
        # writes: config.json carries both.
        config_json={"layers_block_type": list(_NEMOTRON_H_LAYERS),
                      "mtp_layers_block_type": ["attention", "moe"], "mamba_n_groups": 1},
        attention="harness.parity.mamba:backend",
        setup="harness.parity.mamba:setup",
        # Its Mamba2 layers are SGLang's MambaMixer2: decode and verify stop where
        # granitemoehybrid's do. An idle batch runs: each mixer layer returns before
        # its mixer for one (nemotron_h.py:620-621).
        cannot_run={k: v for k, v in _MAMBA2_CANNOT_RUN.items()
                    if k in ("0.5.23:decode", "0.5.23:verify")},
    )
)
