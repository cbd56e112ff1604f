"""Gemma 3 and Gemma 4 text models: ``Gemma3TextModel`` (gemma3_causal.py) and
``Gemma4TextModel`` (gemma4_causal.py).

Both layers return the full residual stream (no residual threaded between layers), so
a layer's complete output is its first tuple element. Both models capture
``hidden_states`` at the top of the loop and the final layer (``num_layers``) after
the loop, before the final norm.
"""

from __future__ import annotations

from harness.standins.models import REDUCE_SELF, ModelSpec, hf_config


def _layer_types(n: int) -> list:
    # Gemma's 5 sliding : 1 full pattern, squeezed: every 4th layer is full attention.
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def _hidden_only(out):
    """The layer's complete output: gemma layers return ``(hidden_states,)`` or
    ``(hidden_states, None)`` (the residual is added inside the layer)."""
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------- gemma3


def _gemma3_config(tc):
    from transformers import Gemma3TextConfig

    return hf_config(
        tc,
        Gemma3TextConfig,
        hidden_activation="gelu_pytorch_tanh",
        # Gemma3TextModel reads rope_parameters["full_attention"]["factor"] (linear
        # scaling of the global RoPE) and the sliding theta.
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        layer_types=_layer_types(tc.num_layers),
        query_pre_attn_scalar=tc.hidden_size // 4,
        sliding_window=128,
    )


def _gemma3_construct(cls, config):
    """The real constructor; then each attention stand-in (and its layer) gets the
    real ``is_sliding`` of its layer (Gemma3Attention: layer_types[layer_id] ==
    "sliding_attention"), which the decoder reads to pick the RoPE tables."""
    model = cls(config, quant_config=None)
    for i, layer in enumerate(model.layers):
        layer.self_attn.is_sliding = layer.is_sliding = (
            config.layer_types[i] == "sliding_attention"
        )
    return model


# ---------------------------------------------------------------- gemma4


_PLE = 4  # hidden_size_per_layer_input
_GEMMA4_ROPE = {
    "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                       "partial_rotary_factor": 0.25},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}


def _gemma4_config(tc):
    from transformers import Gemma4TextConfig

    config = hf_config(
        tc,
        Gemma4TextConfig,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters=_GEMMA4_ROPE,
        # hf_config's default rope_scaling=None would make Gemma4TextConfig drop
        # rope_parameters (Gemma4Attention reads config.rope_parameters[layer_type]).
        rope_scaling=_GEMMA4_ROPE,
        layer_types=_layer_types(tc.num_layers),
        sliding_window=128,
        global_head_dim=tc.hidden_size // 4,
        # Per-layer embeddings (E2B/E4B style) and the parallel MoE block (26B-A4B
        # style) both on, so every branch of Gemma4DecoderLayer.forward that runs on
        # CPU runs here.
        hidden_size_per_layer_input=_PLE,
        vocab_size_per_layer_input=tc.vocab_size,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=tc.intermediate_size,
    )
    config.auxcap_seed = tc.seed  # for _gemma4_construct
    return config


def _gemma4_construct(cls, config):
    """The real constructor, then small-integer per-layer embeddings: the build's
    integer fill skips every parameter named ``embed``, and ``embed_tokens_per_layer``
    would otherwise keep nn.Embedding's random (per-process) initialization."""
    import torch

    from harness.standins.blocks import _full_weight

    model = cls(config, quant_config=None)
    emb = model.embed_tokens_per_layer
    if emb is not None:
        with torch.no_grad():
            seed = getattr(config, "auxcap_seed", 1234)
            full = _full_weight(seed, 998, tuple(emb.weight.shape))
            emb.weight.copy_(full.to(emb.weight.dtype))
    return model


SPECS = [
    ModelSpec(
        name="gemma3",
        module="sglang.srt.models.gemma3_causal",
        model_cls="Gemma3TextModel",
        standins={
            # get_rope (vLLM import) cannot be built on CPU. o_proj is
            # RowParallelLinear with the default reduce_results=True (gemma3_causal
            # 169): it all-reduces itself. The decoder reads self_attn.is_sliding.
            "Gemma3Attention": (REDUCE_SELF, {"is_sliding": False}),
            # down_proj: RowParallelLinear, default reduce_results=True (gemma3_causal 94).
            "Gemma3MLP": (REDUCE_SELF, {}),
        },
        config=_gemma3_config,
        construct=_gemma3_construct,
        layer_output=_hidden_only,
        pin_bugs=frozenset({"B", "R"}),
        wraps=(
            "gemma3_causal.py: Gemma3ForCausalLM",
            "gemma3_mm.py: Gemma3ForConditionalGeneration (via Gemma3ForCausalLM)",
        ),
        note=(
            "Captures the top-of-loop hidden_states (the full stream: layers add the "
            "residual themselves) and the final layer before the final norm "
            "(gemma3_causal 662-665): no bug C. Norms are Gemma3RMSNorm, out of place. "
            "No set_dflash_layers_to_capture in any version."
        ),
    ),
    ModelSpec(
        name="gemma4",
        module="sglang.srt.models.gemma4_causal",
        model_cls="Gemma4TextModel",
        standins={
            # get_rope (vLLM import) cannot be built on CPU. o_proj is
            # RowParallelLinear with the default reduce_results=True (gemma4_causal 334).
            "Gemma4Attention": (REDUCE_SELF, {}),
            # Gemma4MLP = Gemma3MLP: down_proj reduce_results=True (gemma3_causal 94).
            "Gemma4MLP": (REDUCE_SELF, {}),
            # FusedMoE(activation="gelu") fails on CPU; experts reduce_results=True
            # (gemma4_causal 268). The real Gemma4Router runs (its logits are unused).
            "Gemma4MoE": (REDUCE_SELF, {}),
        },
        config=_gemma4_config,
        construct=_gemma4_construct,
        layer_output=_hidden_only,
        pin_bugs=frozenset({"B", "E", "R"}),
        wraps=(
            "gemma4_causal.py: Gemma4ForCausalLM",
            "gemma4_mm.py: Gemma4ForConditionalGeneration (language_model is a Gemma4TextModel)",
        ),
        note=(
            "Captures the top-of-loop hidden_states and the final layer before the final "
            "norm (gemma4_causal 978-980, 1016-1019): no bug C. Bug E: the captured layer "
            "input is the next layer's residual, which pre_feedforward_layernorm(h, "
            "residual) (an SGLang RMSNorm, fused_add_rmsnorm in place on CUDA) "
            "overwrites with input + post_attn_norm(attn_out) (gemma4_causal 659, 673/718)."
        ),
    ),
]
