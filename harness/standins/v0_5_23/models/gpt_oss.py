"""GPT-OSS on 0.5.23: ``GptOssModel`` (gpt_oss.py); every layer is MoE."""

from __future__ import annotations

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.gpt_oss import _config


SPECS = [
    ModelSpec(
        name="gpt_oss",
        module="sglang.srt.models.gpt_oss",
        model_cls="GptOssModel",
        # REDUCE_NONE stand-ins (0.5.23): GptOssAttention's o_proj is
        # RowParallelLinear(reduce_results=False) (attn_boundary.finish declares the
        # sum); GptOssSparseMoeBlock leaves its experts' sum to ffn_boundary.finish
        # (SumGroup.MOE_OUTPUT -> post_experts_reduction_group(), the TP group here).
        standins={},
        build_patches=standins({"GptOssAttention": {}, "GptOssSparseMoeBlock": {}}),
        config=_config,
        # Every layer is sparse; ffn_boundary.finish defers the MoE sum to the next
        # layer's attn_boundary.prepare at TP > 1 (fused_attn_input).
        defers=True,
        pin_bugs=frozenset({"B"}),
        # B: the GPT-OSS family of the 0.5.23 packer migration.
        fixed_by={"B": "gpt-oss-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=("internvl.py (GptOssForCausalLM as its language model)",),
        note="0.5.23: capture_output at attn_boundary.prepare (after the owed MoE sum "
        "is completed unfused: bug A gone) and the final layer through "
        "residual_batch.final_norm(capture=) (gpt_oss.py 725-738; idle batch: "
        "snapshot): K of K.",
    ),
]
