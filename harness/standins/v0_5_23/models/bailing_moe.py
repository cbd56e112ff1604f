"""Bailing MoE (Ling) on 0.5.23: ``BailingMoEModel`` (bailing_moe.py).

The loop passes ``capture_output=aux.capture if i in self.layers_to_capture`` (and a
``captured_last_layer_outputs`` list only for layers with ``_is_layer_to_capture``,
which nothing sets: dead) to ``BailingMoEBlock``, which captures at
``attn_boundary.prepare`` (bailing_moe.py 829-850); ``final_norm`` without a capture:
K-1 of K, silently. The tiny config has one dense layer (``first_k_dense_replace=1``)
and seven MoE layers; every FFN leaves its sum to the next layer's prepare.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.bailing_moe import _config


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
        pin_bugs=frozenset({"B", "C", "R"}),
        fixed_by={"B": "moe-models-aux-packer"},
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
