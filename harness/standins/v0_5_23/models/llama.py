"""Llama family on 0.5.23: ``LlamaModel`` (llama.py) and ``Llama4Model`` (llama4.py)."""

from __future__ import annotations

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.llama import _llama4_config, _llama_config


SPECS = [
    ModelSpec(
        name="llama",
        module="sglang.srt.models.llama",
        model_cls="LlamaModel",
        # Installed by build_patches (0.5.23 stand-ins, REDUCE_NONE): LlamaDecoderLayer
        # builds both with reduce_results=not stage_boundaries (False; llama.py
        # 342-365); attn_boundary.finish declares the attention partial (DeclaredSum
        # ATTN_TP), ffn_boundary.finish defers the MLP partial or completes it. The
        # layer calls input_layernorm.fuse_input_quant(self_attn.qkv_proj) and
        # post_attention_layernorm.fuse_input_quant(mlp.gate_up_proj) (372-373).
        standins={},
        build_patches=standins({"LlamaAttention": {"qkv_proj": None},
                                "LlamaMLP": {"gate_up_proj": None}}),
        config=_llama_config,
        # ffn_boundary.finish leaves an UnreducedOutput for the next layer's
        # attn_boundary.prepare at TP > 1 (fused_attn_input): fusion modes apply.
        defers=True,
        pin_bugs=frozenset({"B", "C"}),
        # B: the first family of the 0.5.23 packer migration (one patch per family).
        fixed_by={"B": "llama-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=("llama.py: LlamaForCausalLM, Phi3ForCausalLM, InternLM3ForCausalLM",),
        note="0.5.23: capture_output=aux.capture at attn_boundary.prepare of layer i "
        "(llama.py 485-505); the last layer is never captured (final_norm without "
        "capture): K-1 of K, silently.",
    ),
    ModelSpec(
        name="llama4",
        module="sglang.srt.models.llama4",
        model_cls="Llama4Model",
        standins={},
        build_patches=standins({
            # o_proj reduce_results=False (llama4.py 282).
            "Llama4Attention": {},
            # MoE layers: experts and shared expert reduce_results=False (125, 142); the
            # sum is left to ffn_boundary.finish.
            "Llama4MoE": {},
            # Dense layers: llama's LlamaMLP as imported into llama4, built with
            # reduce_results=False (420).
            "LlamaMLP": {"gate_up_proj": None},
        }),
        config=_llama4_config,
        defers=True,
        pin_bugs=frozenset({"B", "C"}),
        fixed_by={"B": "llama-style-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=(
            "llama4.py: Llama4ForCausalLM",
            "mllama4.py: Llama4ForConditionalGeneration (via Llama4ForCausalLM)",
        ),
        note="0.5.23: capture_output at attn_boundary.prepare of layer i (llama4.py "
        "522-531); the loop is range(len(self.layers)) and final_norm takes no capture: "
        "K-1 of K, silently.",
    ),
]
