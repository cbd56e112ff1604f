"""GPT-OSS: ``GptOssModel`` (gpt_oss.py); every layer is MoE and defers its all-reduce."""

from __future__ import annotations

from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, ModelSpec, hf_config


def _config(tc):
    from sglang.srt.models.gpt_oss import GptOssConfig

    return hf_config(
        tc,
        GptOssConfig,
        layer_types=["sliding_attention", "full_attention"] * (tc.num_layers // 2),
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=7.0,
        dtype="float32",
    )


SPECS = [
    ModelSpec(
        name="gpt_oss",
        module="sglang.srt.models.gpt_oss",
        model_cls="GptOssModel",
        standins={
            # o_proj: RowParallelLinear(reduce_results=False); the communicator reduces.
            "GptOssAttention": (REDUCE_NONE, {}),
            # all-reduces unless should_allreduce_fusion (deferred to the next layer).
            "GptOssSparseMoeBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_config,
        defers=True,
        pin_bugs=frozenset({"A", "B", "C"}),
        wraps=("internvl.py (GptOssForCausalLM as its language model)",),
    ),
]
