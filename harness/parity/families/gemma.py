"""Gemma 3 and Gemma 4: gemma3_causal.py (``Gemma3ForCausalLM``), gemma3_mm.py
(``Gemma3ForConditionalGeneration``, which wraps it), gemma4_causal.py and gemma4_mm.py
(``Gemma4ForConditionalGeneration``), against transformers' ``Gemma3ForCausalLM``,
``Gemma3ForConditionalGeneration`` and ``Gemma4ForConditionalGeneration``.

Their decoder layers add the residual themselves and all-reduce their own row-parallel
outputs (nothing defers, docs/MODELS.md). Sliding-window layers run on ``torch_native``
(its window mask); the multimodal wrappers get a tiny vision tower and text-only prompts.
"""

from __future__ import annotations

import dataclasses
import functools

from harness.parity.families import IDLE_ROPE, LONG_WINDOW, Family, tiny_fields

# Real Gemma 3 layouts interleave five sliding-window layers with one global layer;
# the tiny models keep the interleave (and a window shorter than the 7-token prompt).
_LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
_LAYER_TYPES_6 = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def _gemma3_text():
    return tiny_fields(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=list(_LAYER_TYPES),
        # Global layers: "linear" RoPE of factor 1, the same frequencies as "default".
        # The pin's Gemma3TextModel.__init__ (gemma3_causal.py:585) reads
        # rope_parameters["full_attention"]["factor"] unconditionally, so a checkpoint
        # without a factor (rope_type "default", Gemma 3 1B) is a KeyError there.
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 1.0,
                                            "rope_theta": 1000000.0}},
        # Gemma checkpoints tie the LM head to the embeddings.
        tie_word_embeddings=True,
    )


# A SigLIP tower of one layer: a 28x28 image, 2x2 patches, pooled to one token.
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, image_size=28, patch_size=14,
               layer_norm_eps=1e-6, vision_use_head=False)
# Image-token ids inside the tiny vocabulary that the parity prompts never use.
_MM_TOKENS = dict(boi_token_index=154, eoi_token_index=155, image_token_index=156)


def _mm(text: dict, vision: dict, **fields) -> dict:
    """A multimodal config: ``text`` as text_config, plus the text model's vocabulary and
    depth at the top level too (what the parity test reads: ``num_hidden_layers``,
    ``vocab_size``; transformers keeps them as plain attributes, unused)."""
    return dict(text_config=text, vision_config=vision,
                num_hidden_layers=text["num_hidden_layers"], vocab_size=text["vocab_size"],
                initializer_range=text["initializer_range"],
                tie_word_embeddings=text["tie_word_embeddings"], dtype="float32", **fields)


def _gemma3_mm():
    # Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration): linear RoPE scaling (factor 8)
    # on the global layers.
    text = _gemma3_text()
    text["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    return _mm(text, dict(_SIGLIP), mm_tokens_per_image=1, **_MM_TOKENS)


def _vision_model_prefix(model) -> None:
    """Save the vision tower under ``vision_tower.vision_model.*``, as released Gemma
    checkpoints hold it and SGLang's loaders look it up. transformers 5 builds SigLIP
    without its ``vision_model`` level (it drops the prefix when loading) and
    ``save_pretrained`` writes ``vision_tower.embeddings.*``, which SGLang's gemma3_mm
    ``load_weights`` does not know (KeyError). Text-only prompts never run the tower."""
    import torch

    class _Tower(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.vision_model = inner

        def forward(self, *args, **kwargs):
            return self.vision_model(*args, **kwargs)

    inner = model.model
    if not hasattr(inner.vision_tower, "vision_model"):
        inner.vision_tower = _Tower(inner.vision_tower)


def _gemma4_text(window: int = LONG_WINDOW, **fields):
    # Gemma 4's text layout: sliding layers with a default RoPE, global layers with a
    # wider head (global_head_dim) and "proportional" partial RoPE.
    # The window (LONG_WINDOW) is longer than the sequences, so the captures are checked
    # against transformers on both bases; ``gemma4_window`` keeps a window of 4, where
    # the pin disagrees: its Gemma4Attention hands RadixAttention config.sliding_window
    # itself (gemma4_causal.py:298-300) while SGLang's window is exclusive of the
    # current token (gemma3_causal.py and 0.5.23's gemma4_causal.py:326-328 pass
    # sliding_window - 1), so the pin's sliding layers attend one token more than
    # transformers' (fixed upstream in 0.5.23).
    fields.setdefault("layer_types", list(_LAYER_TYPES))
    return tiny_fields(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=window,
        global_head_dim=32,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        **fields,
    )


# A Gemma 4 vision tower of one layer (text-only prompts never run it).
_GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
_GEMMA4_TOKENS = dict(boi_token_id=150, eoi_token_id=151, image_token_id=152,
                      video_token_id=154, boa_token_id=155, eoa_token_index=156,
                      audio_token_id=157)


def _gemma4(window: int = LONG_WINDOW):
    # Gemma 4 E2B/E4B: per-layer embeddings, and the last layers reuse the K/V of the
    # last earlier layer of their type (num_kv_shared_layers) with a double-wide MLP.
    text = _gemma4_text(
        window=window,
        num_hidden_layers=6,
        layer_types=list(_LAYER_TYPES_6),
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=160,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    )
    return _mm(text, dict(_GEMMA4_VISION), audio_config=None, **_GEMMA4_TOKENS)


def _gemma4_moe():
    # Gemma 4 26B-A4B: a routed MoE block beside the dense MLP in every layer, no
    # per-layer embeddings; the global layers use K as V (attention_k_eq_v) with their
    # own KV head count.
    text = _gemma4_text(
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    )
    return _mm(text, dict(_GEMMA4_VISION), audio_config=None, **_GEMMA4_TOKENS)


def moe_setup() -> None:
    """``gemma4_moe``'s setup: the gated-GELU MoE stand-in where the pin refuses it, and
    ``Gemma4RMSNorm`` computed as its CUDA path does. SGLang's ``Gemma4Router`` folds
    ``router.scale * hidden_size ** -0.5`` into a ``with_scale=False`` norm's weight,
    which ``forward_cuda`` applies and ``forward_native`` (CPU without AMX, and ROCm)
    drops, so on the CPU the router logits lose that scale and routing differs from
    transformers (a genuine SGLang bug off CUDA, both bases:
    ``harness.standins.cpu_kernels.gemma4_norm``)."""
    from harness.standins.cpu_kernels import gemma4_norm, moe_gelu

    moe_gelu.install()
    gemma4_norm.install()


FAMILIES = [
    Family(
        name="gemma3",
        sglang_file="gemma3_causal.py",
        hf_config_class="Gemma3TextConfig",
        hf_model_class="Gemma3ForCausalLM",
        config=_gemma3_text,
        spec="gemma3",
    ),
    Family(
        name="gemma3_mm",
        sglang_file="gemma3_mm.py",
        hf_config_class="Gemma3Config",
        hf_model_class="Gemma3ForConditionalGeneration",
        config=_gemma3_mm,
        spec="gemma3",
        hf_final_norm="model.language_model.norm",
        prepare=_vision_model_prefix,
    ),
    Family(
        name="gemma4",
        sglang_file="gemma4_causal.py",
        hf_config_class="Gemma4Config",
        hf_model_class="Gemma4ForConditionalGeneration",
        config=_gemma4,
        spec="gemma4",
        hf_final_norm="model.language_model.norm",
        # The model runner's hybrid-SWA pool: the sliding and global layers have
        # different head dims (head_dim, global_head_dim).
        attention="harness.parity.swa:pools",
        cannot_run=IDLE_ROPE,
    ),
    Family(
        name="gemma4_moe",
        sglang_file="gemma4_causal.py",
        hf_config_class="Gemma4Config",
        hf_model_class="Gemma4ForConditionalGeneration",
        config=_gemma4_moe,
        spec="gemma4",
        hf_final_norm="model.language_model.norm",
        attention="harness.parity.swa:pools",
        # The pin's CPU MoE path refuses activation="gelu" (0.5.23's runs it); the
        # router's folded scale needs the CUDA norm's semantics (see moe_setup).
        setup="harness.parity.families.gemma:moe_setup",
        cannot_run=IDLE_ROPE,
    ),
]
# Gemma 4 with a window shorter than the prompts: the pin's sliding layers attend one
# token more than transformers' (see _gemma4_text); 0.5.23 matches.
FAMILIES.append(dataclasses.replace(
    FAMILIES[2], name="gemma4_window", config=functools.partial(_gemma4, window=4),
    known_failures={"0.5.13.post1": (
        "the pin's gemma4_causal.py:298-300 hands transformers' inclusive sliding_window to "
        "RadixAttention's exclusive window: its sliding layers attend one token more than "
        "transformers' (0.5.23 passes sliding_window - 1)")},
))
