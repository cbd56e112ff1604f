"""Llama family: ``LlamaModel`` (llama.py) and ``Llama4Model`` (llama4.py)."""

from __future__ import annotations

from harness.standins.models import (
    REDUCE_DEFERABLE,
    REDUCE_NONE,
    REDUCE_SELF,
    ModelSpec,
    hf_config,
)


def _llama_config(tc):
    from transformers import LlamaConfig

    return hf_config(tc, LlamaConfig)


def _llama4_config(tc):
    from transformers import Llama4TextConfig

    return hf_config(
        tc,
        Llama4TextConfig,
        intermediate_size_mlp=tc.intermediate_size,
        num_local_experts=4,
        num_experts_per_tok=1,
        # Llama 4 Maverick interleaves: every 2nd layer (layer_id 1, 3, ...) is MoE,
        # the others dense LlamaMLP (Llama4DecoderLayer._is_moe_layer).
        interleave_moe_layer_step=2,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
    )


SPECS = [
    ModelSpec(
        name="llama",
        module="sglang.srt.models.llama",
        model_cls="LlamaModel",
        # o_proj and down_proj are RowParallelLinear(reduce_results=True).
        standins={"LlamaAttention": (REDUCE_SELF, {}), "LlamaMLP": (REDUCE_SELF, {})},
        config=_llama_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("llama.py: LlamaForCausalLM, Phi3ForCausalLM, InternLM3ForCausalLM",),
    ),
    ModelSpec(
        name="llama4",
        module="sglang.srt.models.llama4",
        model_cls="Llama4Model",
        standins={
            # o_proj: RowParallelLinear(reduce_results=False) (llama4 280-289): the
            # LayerCommunicator's prepare_mlp all-reduces.
            "Llama4Attention": (REDUCE_NONE, {}),
            # all-reduces unless use_reduce_scatter (should_skip_post_experts_all_reduce,
            # llama4 152-156); experts and shared expert are reduce_results=False inside.
            "Llama4MoE": (REDUCE_DEFERABLE, {}),
            # llama's LlamaMLP as imported into llama4 (dense layers): down_proj
            # reduce_results=True, skip_all_reduce=use_reduce_scatter (llama 122).
            "LlamaMLP": (REDUCE_DEFERABLE, {}),
        },
        config=_llama4_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=(
            "llama4.py: Llama4ForCausalLM",
            "mllama4.py: Llama4ForConditionalGeneration (via Llama4ForCausalLM; no DFlash setter)",
        ),
        note=(
            "Captures hidden_states + residual at the top of the loop (llama4 541-544, no "
            "None guard: index 0 raises TypeError). No start_layer/end_layer: the loop is "
            "range(len(self.layers)), so the last layer is never captured. Layers use a "
            "LayerCommunicator but never defer their all-reduce."
        ),
    ),
]
