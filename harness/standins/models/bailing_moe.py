"""Bailing MoE (Ling): ``BailingMoEModel`` (bailing_moe.py).

Captures at the top of the layer loop (``hidden_states if residual is None else
hidden_states + residual``, in a list; bailing_moe.py:773-776). Its decoder layer
(``BailingMoEBlock``) already calls the communicator's
``prepare_attn_and_capture_last_layer_outputs``, but the model passes it a list only
for layers with ``_is_layer_to_capture``, which nothing in bailing_moe.py sets, so
that path is dead at the pin. The layers use the LayerCommunicator and defer the
MLP/MoE all-reduce into the next layer's fused norm; the tiny config has one dense
layer (``first_k_dense_replace=1``) and seven MoE layers.
"""

from __future__ import annotations

from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, ModelSpec, hf_config


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
        standins={
            # Built with reduce_results=False (bailing_moe.py:578-585); its `dense`
            # RowParallelLinear takes it (479-488): the communicator all-reduces.
            "BailingMoEAttention": (REDUCE_NONE, {}),
            # Dense layers: down_proj reduce_results=True (bailing_moe.py:98, 115-124)
            # with skip_all_reduce=should_allreduce_fusion or use_reduce_scatter (142-144).
            "BailingMoEMLP": (REDUCE_DEFERABLE, {}),
            # all-reduces unless should_skip_post_experts_all_reduce(is_tp_path=True,
            # use_reduce_scatter, should_allreduce_fusion) (bailing_moe.py:384-389).
            "BailingMoESparseMoeBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_config,
        defers=True,
        embed_attr="word_embeddings",
        pin_bugs=frozenset({"A", "B", "C", "R"}),
        wraps=(
            "bailing_moe.py: BailingMoEForCausalLM, BailingMoeForCausalLM, "
            "BailingMoeV2ForCausalLM (set_eagle3_layers_to_capture only)",
            "sarvam_moe.py: SarvamMoEForCausalLM (subclass: same model and setter)",
            "bailing_moe_nextn.py (BailingMoEBlock)",
        ),
        note=(
            "Not an auto-fused arch: bug A needs --enable-flashinfer-allreduce-fusion or "
            "aiter fusion. The layer's captured_last_layer_outputs path is dead "
            "(_is_layer_to_capture is never set). embedding_dropout is never applied."
        ),
    ),
]
