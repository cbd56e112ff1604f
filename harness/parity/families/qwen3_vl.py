"""Qwen3-VL: ``Qwen3VLForConditionalGeneration`` over ``Qwen3LLMModel`` (qwen3_vl.py) and
``Qwen3VLMoeForConditionalGeneration`` over ``Qwen3MoeLLMModel`` (qwen3_vl_moe.py);
transformers' ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``.

The checkpoints are the wrappers real Qwen3-VL checkpoints name (``architectures``), with
a tiny vision tower, so SGLang resolves the class the engine would and its setters run
through the wrapper. Prompts are text only: no deepstack (image tokens are out of this
tier's scope), and the M-RoPE positions are the text positions on all three axes, as
SGLang's ``ForwardBatch`` makes them for a request without images
(``harness.parity.runner.Requests``).

Qwen2.5-VL the same way: ``Qwen2_5_VLForConditionalGeneration`` over qwen2.py's
``Qwen2Model`` (qwen2_5_vl.py), transformers' ``Qwen2_5_VLForConditionalGeneration``.
"""

from __future__ import annotations

from harness.parity.families import IDLE_MOE, IDLE_ROPE, Family, tiny_fields

# head_dim 16: M-RoPE splits its 8 rotary frequencies over (t, h, w), interleaved as in
# the released checkpoints ("mrope_interleaved": true, sections summing to head_dim / 2).
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
         "mrope_interleaved": True}

# Vision tower: one block, out_hidden_size = the text hidden size, one deepstack merger.
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
               num_position_embeddings=16, deepstack_visual_indexes=[0],
               initializer_range=0.2)


def _text(**fields):
    text = tiny_fields(rope_parameters=dict(_ROPE), **fields)
    for key in ("bos_token_id", "eos_token_id", "dtype"):
        text.pop(key)
    return text


def _wrapper(text: dict) -> dict:
    """The wrapper config's arguments. ``vocab_size`` is repeated at the top level (the
    tier draws its prompts from it there); SGLang copies every text field to the top
    level of a multimodal config anyway (``utils/hf_transformers/config.py`` ``get_config``)."""
    return dict(text_config=text, vision_config=dict(_VISION), vocab_size=text["vocab_size"],
                tie_word_embeddings=False, dtype="float32")


def _dense():
    return _wrapper(_text())


def _moe():
    return _wrapper(_text(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          decoder_sparse_step=1, mlp_only_layers=[]))


def _released_expert_layout(model) -> None:
    """Save the fused experts in the released checkpoints' layout.

    Released Qwen3-VL-MoE checkpoints store ``experts.gate_up_proj`` as
    ``[experts, hidden, 2 * moe_intermediate]`` and ``experts.down_proj`` as
    ``[experts, moe_intermediate, hidden]``; transformers 5 transposes them on load
    (its qwen3_vl_moe conversion mapping: ``Transpose(1, 2, check_dims=True)``), and
    SGLang's ``load_weights`` transposes them back (qwen3_vl_moe.py, ``is_fused_expert``).
    Saving a model built from a config, transformers reverses that ``Transpose`` only when
    the shapes differ from its own parameters', which they never do, so it would write
    its in-memory layout. The conversions attached here (as ``from_pretrained`` attaches
    the ones it loaded with) transpose unconditionally on save.
    """
    from transformers.core_model_loading import Transpose, WeightConverter

    model._weight_conversions = [
        WeightConverter(source_patterns=f"mlp.experts.{name}",
                        target_patterns=f"mlp.experts.{name}",
                        operations=[Transpose(1, 2)])
        for name in ("gate_up_proj", "down_proj")
    ]


FAMILIES = [
    Family(
        name="qwen3_vl",
        sglang_file="qwen3_vl.py",
        hf_config_class="Qwen3VLConfig",
        hf_model_class="Qwen3VLForConditionalGeneration",
        config=_dense,
        spec="qwen3_vl",
        hf_final_norm="model.language_model.norm",
    ),
    Family(
        name="qwen3_vl_moe",
        sglang_file="qwen3_vl_moe.py",
        hf_config_class="Qwen3VLMoeConfig",
        hf_model_class="Qwen3VLMoeForConditionalGeneration",
        config=_moe,
        spec="qwen3_vl_moe",
        defers=True,
        prepare=_released_expert_layout,
        hf_final_norm="model.language_model.norm",
        cannot_run=IDLE_MOE,
    ),
]


# Qwen2.5-VL: SGLang's Qwen2_5_VLForConditionalGeneration over qwen2.py's Qwen2Model;
# M-RoPE not interleaved (sections [t, h, w] in the released proportions 16:24:24,
# summing to head_dim / 2 = 8); a one-block vision tower (window attention, its only
# block a full-attention one) whose merger outputs the text hidden size.
_QWEN2_5_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_QWEN2_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                       patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                       window_size=16, fullatt_block_indexes=[0], out_hidden_size=64,
                       initializer_range=0.2)


def _qwen2_5_vl():
    text = tiny_fields(rope_parameters=dict(_QWEN2_5_ROPE))
    for key in ("bos_token_id", "eos_token_id", "dtype"):
        text.pop(key)
    return dict(text_config=text, vision_config=dict(_QWEN2_5_VISION),
                vocab_size=text["vocab_size"], tie_word_embeddings=False, dtype="float32")


FAMILIES.append(
    Family(
        name="qwen2_5_vl",
        sglang_file="qwen2_5_vl.py",
        hf_config_class="Qwen2_5_VLConfig",
        hf_model_class="Qwen2_5_VLForConditionalGeneration",
        config=_qwen2_5_vl,
        # The wrapper's language model is qwen2.py's Qwen2Model (the qwen2 spec's wraps).
        spec="qwen2",
        hf_final_norm="model.language_model.norm",
        cannot_run=IDLE_ROPE,
    )
)
