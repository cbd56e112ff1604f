"""GLM family on 0.5.23: ``Glm4Model`` (glm4.py), ``Glm4MoeModel`` (glm4_moe.py) and
``Glm4MoeLiteModel`` (glm4_moe_lite.py).

All three capture with ``capture_output=aux.capture`` at ``attn_boundary.prepare`` of
layer ``i`` (``i in self.layers_to_capture``) and end with ``final_norm`` without a
capture: the last layer is silently never captured (K-1 of K). glm4_moe and
glm4_moe_lite leave the FFN sum to the next layer's ``attn_boundary.prepare`` at
TP > 1, so the fusion modes apply (glm4's output norms make its FFN complete at exit);
the tiny MoE configs have one dense layer (``first_k_dense_replace=1``) and seven MoE
layers, so both the dense MLP and the MoE block run.
"""

from __future__ import annotations

from harness.standins.blocks import TinyConfig
from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_plain,
    run_scattered,
    standin_class,
    standins,
)
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.glm import _glm4_config, _glm4_moe_config, _glm4_moe_lite_config

_TINY = TinyConfig()


def _lite_patches(mod):
    return [
        # imported from deepseek_v2 (glm4_moe_lite.py 83), built with
        # reduce_results=False (442); its qkv_latent_func is prepare_qkv_latent (482).
        (mod, "DeepseekV2AttentionMLA", mla_standin(mod.DeepseekV2AttentionMLA, _TINY)),
        # Dense layer 0: reduce_results=False (468); MoE layers leave their sum to
        # ffn_boundary.finish.
        (mod, "Glm4MoeLiteMLP", standin_class(mod.Glm4MoeLiteMLP, _TINY, {})),
        (mod, "Glm4MoeLiteSparseMoeBlock",
         standin_class(mod.Glm4MoeLiteSparseMoeBlock, _TINY, {})),
    ]


SPECS = [
    ModelSpec(
        name="glm4",
        module="sglang.srt.models.glm4",
        model_cls="Glm4Model",
        standins={},
        # Glm4Attention: o_proj reduce_results=False (glm4.py 168); Glm4MLP built with
        # reduce_results=False (255). The attention and FFN outputs pass through the
        # sandwich norms as the stages' output transforms (post_self_attn_layernorm,
        # post_mlp_layernorm; 267-296), applied after the sum completes.
        build_patches=standins({"Glm4Attention": {}, "Glm4MLP": {}}),
        config=_glm4_config,
        # The sandwich norm (post_mlp_layernorm) is the FFN's output transform, applied
        # to the complete sum: the FFN completes at its exit and never defers (no
        # UnreducedOutput, no fused kernel at TP > 1: checked).
        defers=False,
        pin_bugs=frozenset({"B", "C", "U"}),
        # B: the GLM-4 family of the 0.5.23 packer migration.
        fixed_by={"B": "glm4-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=(
            "glm4.py: Glm4ForCausalLM (no set_eagle3/dflash setter: dead path)",
            "glm4v.py, glm_ocr.py (Glm4Model as the language model; no setter either)",
        ),
        note="No capture setter: the spec sets Glm4Model.layers_to_capture directly. "
        "capture_output at attn_boundary.prepare (glm4.py 400); final_norm without "
        "capture: K-1 of K.",
    ),
    ModelSpec(
        name="glm4_moe",
        module="sglang.srt.models.glm4_moe",
        model_cls="Glm4MoeModel",
        standins={},
        build_patches=standins({
            # o_proj reduce_results=False (glm4_moe.py 274); the layer reads
            # self_attn.qkv_proj in __init__ (_detect_attn_quant_format, 805-809).
            "Glm4MoeAttention": {"qkv_proj": None},
            # Dense layer 0: reduce_results=False (753).
            "Glm4MoeMLP": {},
            # Its experts' sum is left to ffn_boundary.finish (SumGroup.MOE_OUTPUT).
            "Glm4MoeSparseMoeBlock": {},
        }),
        config=_glm4_moe_config,
        defers=True,
        pin_bugs=frozenset({"B", "C", "R"}),
        # B: the GLM-4 family of the 0.5.23 packer migration.
        fixed_by={"B": "glm4-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=(
            "glm4_moe.py: Glm4MoeForCausalLM (set_eagle3_layers_to_capture only)",
            "glm4v_moe.py: Glm4vMoeForConditionalGeneration (Glm4MoeModel)",
        ),
        note="capture_output at attn_boundary.prepare, after the owed sum (no bug A); "
        "K-1 of K. Its TBO branch (glm4_moe.py 948-968) never runs: "
        "OperationsStrategy.init_new_tbo raises NotImplementedError for "
        "Glm4MoeDecoderLayer, capturing or not (no bug T).",
    ),
    ModelSpec(
        name="glm4_moe_lite",
        module="sglang.srt.models.glm4_moe_lite",
        model_cls="Glm4MoeLiteModel",
        standins={},
        build_patches=_lite_patches,
        config=_glm4_moe_lite_config,
        defers=True,
        pin_bugs=frozenset({"B", "C"}),
        # B: the GLM-4 family of the 0.5.23 packer migration.
        fixed_by={"B": "glm4-aux-packer"},
        layer_output=layer_output,
        # As Glm4MoeLiteForCausalLM.forward (maybe_input_scattered; a no-op here:
        # AttnTpContext.init_context is called only by DeepSeek/GLM-5 models).
        run=run_scattered,
        wraps=(
            "glm4_moe_lite.py: Glm4MoeLiteForCausalLM (set_eagle3 and set_dflash)",
        ),
        note="set_eagle3_layers_to_capture maps ids +1 only when layer_ids[0] == 1, "
        "else raw. capture_output at attn_boundary.prepare; K-1 of K. Its TBO branch "
        "(647-670) never runs: init_new_tbo raises NotImplementedError for "
        "Glm4MoeLiteDecoderLayer (no bug T).",
    ),
]
