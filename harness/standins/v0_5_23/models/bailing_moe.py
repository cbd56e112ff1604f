"""Bailing MoE (Ling) on 0.5.23: ``BailingMoEModel`` (bailing_moe.py).

The loop passes ``capture_output=aux.capture if i in self.layers_to_capture`` (and a
``captured_last_layer_outputs`` list only for layers with ``_is_layer_to_capture``,
which nothing sets: dead) to ``BailingMoEBlock``, which captures at
``attn_boundary.prepare`` (bailing_moe.py 829-850); ``final_norm`` without a capture:
K-1 of K, silently. The tiny config has one dense layer (``first_k_dense_replace=1``)
and seven MoE layers; every FFN leaves its sum to the next layer's prepare.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import layer_output, run_plain, standins


def _config(tc):
    return hf_config(
        tc,
        architectures=["BailingMoeV2ForCausalLM"],
        embedding_dropout=0.0,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=tc.intermediate_size,
        norm_topk_prob=True,
        first_k_dense_replace=1,  # layer 0 dense, layers 1..7 MoE
        use_bias=False,
        use_qkv_bias=False,
        use_qk_norm=False,
        partial_rotary_factor=0.5,
    )


SPECS = [
    ModelSpec(
        name="bailing_moe",
        module="sglang.srt.models.bailing_moe",
        model_cls="BailingMoEModel",
        standins={},
        build_patches=standins({
            # Built with reduce_results=False (bailing_moe.py 665, 690); the MoE block
            # leaves its experts' sum to ffn_boundary.finish.
            "BailingMoEAttention": {},
            "BailingMoEMLP": {},
            "BailingMoESparseMoeBlock": {},
        }),
        config=_config,
        defers=True,
        embed_attr="word_embeddings",
        pin_bugs=frozenset({"B", "C"}),
        layer_output=layer_output,
        run=run_plain,
        wraps=(
            "bailing_moe.py: BailingMoEForCausalLM, BailingMoeForCausalLM, "
            "BailingMoeV2ForCausalLM (set_eagle3_layers_to_capture only)",
            "sarvam_moe.py: SarvamMoEForCausalLM (subclass: same model and setter)",
        ),
        note="capture_output at attn_boundary.prepare (after the owed sum: no bug A); "
        "the captured_last_layer_outputs path is dead (_is_layer_to_capture never set).",
    ),
]
