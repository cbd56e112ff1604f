"""LFM2 and LFM2-MoE: ``Lfm2ForCausalLM`` (lfm2.py) and ``Lfm2MoeForCausalLM``
(lfm2_moe.py), Liquid AI's hybrids of gated short-conv and attention layers, against
transformers' ``Lfm2ForCausalLM`` and ``Lfm2MoeForCausalLM``; 0.5.23 only (the pin's
lfm2 files capture nothing).

The conv layers run SGLang's own ``Lfm2ShortConv`` / ``Lfm2MoeShortConv`` against the
conv windows of a ``MambaPool``, through a ``ShortConvHybridAttnBackend`` whose
full-attention half is ``torch_native`` (:mod:`harness.parity.short_conv`, the
families' ``attention`` and ``setup`` hooks); their conv kernels are SGLang's Triton
ones, interpreted, at every forward (the extend's varlen conv, the decode update, the
verify update with its speculative tape). Each has a DFlash setter only
(``set_dflash_layers_to_capture``): the model runner refuses EAGLE3 for it. An idle
batch runs (every decoder layer skips its body for one: lfm2.py:487, lfm2_moe.py:494)
and hands on no captures by design (the spec's ``idle_captures``: the after-loop
capture is gated on a non-idle batch, and DFlash skips idle batches).
"""

from __future__ import annotations

from harness.parity.families import Family, tiny_fields

NEWEST = ("0.5.23",)

# The released schedules' shape (LFM2-1.2B: conv, conv, attention, ..., a conv layer
# last): conv layers around one full-attention layer, so the DFlash ids (0, 2, 3) hold
# the input of a conv layer, of the attention layer and of the last (conv) layer.
_LAYER_TYPES = ["conv", "conv", "full_attention", "conv"]


def _common(**fields):
    fields = tiny_fields(
        num_hidden_layers=len(_LAYER_TYPES),
        layer_types=list(_LAYER_TYPES),
        norm_eps=1e-6,
        conv_bias=False,  # every released checkpoint
        conv_L_cache=3,  # the conv width (the window holds 2)
        **fields,
    )
    # LFM2's configs name the norm epsilon ``norm_eps``, and size heads by
    # hidden_size / num_attention_heads (64 / 4: tiny_fields' head_dim).
    fields.pop("rms_norm_eps")
    fields.pop("head_dim")
    return fields


def _lfm2():
    # The released FFN sizing (block_auto_adjust_ff_dim): 2/3 of intermediate_size,
    # times the multiplier, rounded up to block_multiple_of: 96 -> 64 here.
    return _common(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                   block_multiple_of=32)


def _lfm2_moe():
    # Layers 0-1 dense (num_dense_layers, as LFM2-8B-A1B), 2-3 MoE: sigmoid routing with
    # the expert bias, renormalised top-k, a routed scaling factor that is seen to apply.
    return _common(num_dense_layers=2, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, use_expert_bias=True, norm_topk_prob=True,
                   routed_scaling_factor=2.0)


def _family(name, config, hf_prefix):
    return Family(
        name=name,
        sglang_file=f"{name}.py",
        hf_config_class=f"{hf_prefix}Config",
        hf_model_class=f"{hf_prefix}ForCausalLM",
        config=config,
        spec=name,
        bases=NEWEST,
        eagle3=False,
        hf_final_norm="model.embedding_norm",
        attention="harness.parity.short_conv:backend",
        setup="harness.parity.short_conv:setup",
    )


FAMILIES = [
    _family("lfm2", _lfm2, "Lfm2"),
    _family("lfm2_moe", _lfm2_moe, "Lfm2Moe"),
]
