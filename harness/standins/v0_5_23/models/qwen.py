"""Qwen family on 0.5.23: ``Qwen2Model`` (qwen2.py), ``Qwen3Model`` (qwen3.py),
``Qwen2MoeModel`` (qwen2_moe.py), ``Qwen3MoeModel`` (qwen3_moe.py), ``Qwen3LLMModel``
(qwen3_vl.py) and ``Qwen3MoeLLMModel`` (qwen3_vl_moe.py).

Two capture mechanisms:

* ``capture_output=aux.capture`` at ``attn_boundary.prepare`` of layer ``i`` when
  ``i in self.layers_to_capture``: Qwen2Model.forward, Qwen3Model.forward (its own
  since 0.5.23), Qwen3LLMModel.forward and Qwen3MoeLLMModel.forward; ``final_norm``
  without capture: the last layer is silently never captured (K-1 of K);
* per-layer ``_is_layer_to_capture`` flags set by ``set_eagle3_layers_to_capture`` /
  ``set_dflash_layers_to_capture`` (``setattr(self.layers[layer_id], ...)``), captured
  through ``attn_boundary.prepare(capture_gathered=aux)``: Qwen2MoeModel.forward (also
  run by Qwen3MoeModel); the setter raises IndexError for ``end_layer``.

Every stand-in is REDUCE_NONE (0.5.23's boundaries own every sum): each original is
built with ``reduce_results=False`` or leaves its sum to ``ffn_boundary.finish``. Every
model's FFN defers its sum to the next layer's ``attn_boundary.prepare`` at TP > 1, so
the fusion modes apply to all of them.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.qwen import (
    _configure_flags,
    _keyword_construct,
    _qwen2_config,
    _qwen2_moe_config,
    _qwen3_config,
    _qwen3_moe_config,
    _qwen3_vl_config,
    _qwen3_vl_moe_config,
)

# qwen3.py: Qwen3Attention (o_proj reduce_results=False, qwen3.py 212) and Qwen3MLP =
# qwen2.Qwen2MLP built with reduce_results=False (409). The layer reads
# mlp.gate_up_proj / down_proj only on NPU.
_QWEN3 = {"Qwen3Attention": {}, "Qwen3MLP": {"gate_up_proj": None}}
# qwen3_moe.py: Qwen3MoeAttention (o_proj reduce_results=False, 542),
# Qwen3MoeSparseMoeBlock (its sum left to ffn_boundary.finish, SumGroup.MOE_OUTPUT).
_QWEN3_MOE = {"Qwen3MoeAttention": {}, "Qwen3MoeSparseMoeBlock": {}}


def _spec(**kw):
    kw.setdefault("standins", {})
    kw.setdefault("defers", True)
    return ModelSpec(layer_output=layer_output, run=run_plain, **kw)


SPECS = [
    _spec(
        name="qwen2",
        module="sglang.srt.models.qwen2",
        model_cls="Qwen2Model",
        # Qwen2Attention: o_proj reduce_results=False (qwen2.py 203); Qwen2MLP built with
        # reduce_results=False (301). fuse_input_quant reads qkv_proj / gate_up_proj.
        build_patches=standins({"Qwen2Attention": {"qkv_proj": None},
                                "Qwen2MLP": {"gate_up_proj": None}}),
        config=_qwen2_config,
        pin_bugs=frozenset({"B", "C", "R"}),
        # B: the Qwen2/Qwen3 family of the 0.5.23 packer migration.
        fixed_by={"B": "qwen-aux-packer"},
        wraps=(
            "qwen2.py: Qwen2ForCausalLM",
            "qwen2_5_vl.py: Qwen2_5_VLForConditionalGeneration (self.model = Qwen2Model)",
        ),
        note="capture_output at attn_boundary.prepare (qwen2.py 455-475); final_norm "
        "without capture: K-1 of K, silently. No set_dflash_layers_to_capture.",
    ),
    _spec(
        name="qwen3",
        module="sglang.srt.models.qwen3",
        model_cls="Qwen3Model",
        build_patches=standins(_QWEN3),
        config=_qwen3_config,
        pin_bugs=frozenset({"B", "C"}),
        # B: the Qwen2/Qwen3 family of the 0.5.23 packer migration.
        fixed_by={"B": "qwen-aux-packer"},
        wraps=("qwen3.py: Qwen3ForCausalLM",),
        note="Own forward since 0.5.23 (qwen3.py 523-540): capture_output at "
        "attn_boundary.prepare; K-1 of K, silently.",
    ),
    _spec(
        name="qwen2_moe",
        module="sglang.srt.models.qwen2_moe",
        model_cls="Qwen2MoeModel",
        # Qwen2MoeAttention: o_proj reduce_results=False (qwen2_moe.py 950);
        # Qwen2MoeSparseMoeBlock built with reduce_results=False (1032).
        build_patches=standins({"Qwen2MoeAttention": {}, "Qwen2MoeSparseMoeBlock": {}}),
        config=_qwen2_moe_config,
        configure=_configure_flags,
        pin_bugs=frozenset({"B", "C", "R", "L"}),
        # B: the Qwen2/Qwen3 family of the 0.5.23 packer migration.
        fixed_by={"B": "qwen-aux-packer"},
        wraps=("qwen2_moe.py: Qwen2MoeForCausalLM",),
        note="capture_gathered through per-layer _is_layer_to_capture flags "
        "(qwen2_moe.py 1196-1202); set_eagle3_layers_to_capture's setattr raises "
        "IndexError for end_layer (1153-1156). TBO refuses Qwen2MoeDecoderLayer "
        "(init_new_tbo raises NotImplementedError); its TBO branch only runs for "
        "qwen3_moe's layers (bug T there).",
    ),
    _spec(
        name="qwen3_moe",
        module="sglang.srt.models.qwen3_moe",
        model_cls="Qwen3MoeModel",
        build_patches=standins(_QWEN3_MOE),
        config=_qwen3_moe_config,
        configure=_configure_flags,
        pin_bugs=frozenset({"B", "C", "T", "L"}),
        # B: the Qwen2/Qwen3 family of the 0.5.23 packer migration.
        fixed_by={"B": "qwen-aux-packer"},
        wraps=(
            "qwen3_moe.py: Qwen3MoeForCausalLM",
            "qwen3_vl_moe.py: Qwen3MoeLLMModel subclasses it but overrides forward "
            "(its own spec)",
        ),
        note="Runs Qwen2MoeModel.forward (flag-based capture_gathered). "
        "set_eagle3_layers_to_capture (qwen2_moe.py 1153-1156) and "
        "set_dflash_layers_to_capture (qwen3_moe.py 987-990) raise IndexError for "
        "end_layer; the hook calls the eagle3 one (same body).",
    ),
    _spec(
        name="qwen3_vl",
        module="sglang.srt.models.qwen3_vl",
        model_cls="Qwen3LLMModel",
        build_patches=standins(_QWEN3, module_name="sglang.srt.models.qwen3"),
        config=_qwen3_vl_config,
        construct=_keyword_construct,
        pin_bugs=frozenset({"B", "C", "R"}),
        fixed_by={"B": "qwen3-vl-aux-packer"},
        wraps=("qwen3_vl.py: Qwen3VLForConditionalGeneration",),
        note="Own forward (qwen3_vl.py 1207-1290) over Qwen3DecoderLayer: "
        "capture_output at attn_boundary.prepare, K-1 of K. Driven without images "
        "(no deepstack).",
    ),
    _spec(
        name="qwen3_vl_moe",
        module="sglang.srt.models.qwen3_vl_moe",
        model_cls="Qwen3MoeLLMModel",
        build_patches=standins(_QWEN3_MOE, module_name="sglang.srt.models.qwen3_moe"),
        config=_qwen3_vl_moe_config,
        construct=_keyword_construct,
        pin_bugs=frozenset({"B", "C"}),
        fixed_by={"B": "qwen3-vl-aux-packer"},
        wraps=("qwen3_vl_moe.py: Qwen3VLMoeForConditionalGeneration",),
        note="Own forward (qwen3_vl_moe.py 85-160) over Qwen3MoeDecoderLayer: "
        "capture_output at attn_boundary.prepare (after the owed sum: no bug A), "
        "K-1 of K. Driven without images (no deepstack).",
    ),
]
