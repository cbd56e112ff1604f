"""Laguna on 0.5.23: ``LagunaModel`` (laguna.py, poolside's Laguna-XS.2).

Each decoder layer is an attention stage and an FFN stage on the layer boundaries:
``LagunaAttention`` (o_proj ``reduce_results=False``) and, per
``config.mlp_layer_types``, a dense ``LagunaMLP`` or a ``LagunaMoE`` (routed experts
and the shared expert, all ``reduce_results=False``); the boundaries own every sum,
so every stand-in is REDUCE_NONE. Captures: ``capture_output=aux.capture`` at
``attn_boundary.prepare`` of layer ``i`` for ``i in layers_to_capture``, and the last
layer's output through ``residual_batch.final_norm(capture=aux.append)``: K of K.
The tiny config keeps the checkpoint's schedule shapes: layer 0 dense, the rest
sparse (``LagunaConfig``'s default ``mlp_layer_types``), sliding and full attention
alternating, per-layer head counts.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import layer_output, run_plain, standins


def _laguna_config(tc):
    from sglang.srt.configs.laguna import LagunaConfig

    n = tc.num_layers
    return hf_config(
        tc,
        LagunaConfig,
        # Laguna-XS.2: sliding-window layers between full-attention ones, each with
        # its own rope parameters (nested by layer type) and head count.
        layer_types=["full_attention" if i % 2 == 0 else "sliding_attention"
                     for i in range(n)],
        num_attention_heads_per_layer=[4 if i % 2 == 0 else 8 for i in range(n)],
        sliding_window=8,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        # mlp_layer_types left to LagunaConfig: ["dense"] + ["sparse"] * (n - 1).
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=tc.intermediate_size,
        shared_expert_intermediate_size=tc.intermediate_size,
        gating="per-head",
    )


SPECS = [
    ModelSpec(
        name="laguna",
        module="sglang.srt.models.laguna",
        model_cls="LagunaModel",
        standins={},
        build_patches=standins({
            # o_proj reduce_results=False (laguna.py 290); attn_boundary.finish
            # declares the sum.
            "LagunaAttention": {},
            # The dense layer's MLP, reduce_results=False (laguna.py 438).
            "LagunaMLP": {},
            # Experts and shared expert reduce_results=False (161, 189): the
            # sum is ffn_boundary.finish's.
            "LagunaMoE": {},
        }),
        config=_laguna_config,
        # The FFN sum is owed past ffn_boundary.finish and completed at the next
        # layer's attn_boundary.prepare (or the final norm) at TP > 1.
        defers=True,
        # B: list + cat. DFlash only (no EAGLE3 setter; the model runner refuses
        # EAGLE3 with one error): not a bug letter.
        pin_bugs=frozenset({"B"}),
        fixed_by={"B": "laguna-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=("laguna.py: LagunaForCausalLM (set_dflash_layers_to_capture only)",),
        note="capture_output at attn_boundary.prepare of layer i (laguna.py 587-597) "
        "and the last layer through residual_batch.final_norm(capture=aux.append) "
        "(pristine 601-609): K of K. set_dflash_layers_to_capture maps HF layer id k "
        "to capture index k + 1; the spec sets LagunaModel.layers_to_capture "
        "(capture indices) directly.",
    ),
]
