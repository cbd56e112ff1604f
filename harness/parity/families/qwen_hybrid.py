"""Hybrid Gated-DeltaNet Qwen: ``Qwen3NextForCausalLM`` (qwen3_next.py) and Qwen3.5,
dense and MoE: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
(qwen3_5.py: the Qwen3-VL wrapper of qwen3_vl.py over the flag-based
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``), against transformers'
``Qwen3NextForCausalLM``, ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForConditionalGeneration``.

Four layers: three Gated DeltaNet ones and a gated full-attention one
(``full_attention_interval`` 4, as released). The GDN layers run SGLang's hybrid
linear-attention backend over its own mamba state pools (:mod:`harness.parity.hybrid`)
and the pure-torch versions of the sgl-kernel CPU ops it and 0.5.23's qwen3_5.py call
(:mod:`harness.standins.cpu_kernels.gated_delta`, :mod:`harness.standins.cpu_kernels.qwen3_5`,
installed by ``setup``). Both layer types defer their MLP all-reduce
(``_sglang_needs_allreduce_fusion``; qwen3_next's last layer too at the pin, until 0008),
so the FlashInfer fusion emulation runs at TP 2.

Qwen3.5 checkpoints name the multimodal wrappers (``architectures``), so SGLang resolves
the class the engine would and captures are requested through the wrapper's setters; the
vision tower is tiny and the prompts text only (no deepstack), with the text positions on
all three M-RoPE axes, as SGLang makes them for a request without images.
"""

from __future__ import annotations

from harness.parity.families import IDLE_MOE, PIN, Family, tiny_fields

# Four layers, the last full attention: as released (full_attention_interval 4).
_INTERVAL = 4


def _gdn_fields(**fields):
    """The tiny hybrid text config: 2 key heads and 4 value heads of 16 (so TP 2 shards
    both), a width-4 conv, a gated full-attention layer with partial rotary 0.25."""
    return tiny_fields(
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **fields,
    )


def _moe_fields():
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, norm_topk_prob=True)


def _next():
    return _gdn_fields(decoder_sparse_step=1, mlp_only_layers=[], **_moe_fields())


# Qwen3.5's M-RoPE, interleaved, as released (sections in the released proportions,
# summing to half the rotary dim: head_dim 32 x partial 0.25 = 8).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
          "mrope_section": [2, 1, 1], "mrope_interleaved": True}

# A one-block vision tower whose merger outputs the text hidden size. Qwen3.5 has no
# deepstack (transformers' vision config has no such field); SGLang's vision config
# class defaults to Qwen3-VL's [8, 16, 24], so the checkpoint says so explicitly.
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
               num_position_embeddings=16, initializer_range=0.2, deepstack_visual_indexes=[])


def _qwen3_5(moe: bool):
    text = _gdn_fields(head_dim=32, rope_parameters=dict(_MROPE),
                       **(_moe_fields() if moe else {}))
    if moe:
        text.pop("norm_topk_prob")  # transformers' Qwen3.5-MoE router always renormalises
    for key in ("bos_token_id", "eos_token_id", "dtype"):
        text.pop(key)
    # num_hidden_layers and vocab_size repeated at the top level, where the tier reads
    # them (SGLang copies the text fields up for a multimodal config anyway).
    return dict(text_config=text, vision_config=dict(_VISION),
                num_hidden_layers=text["num_hidden_layers"], vocab_size=text["vocab_size"],
                tie_word_embeddings=False, dtype="float32")


def _prepare(model) -> None:
    """Before ``save_pretrained``:

    * ``full_attention_interval`` (below);
    * ``linear_num_{key,value}_heads_cpu``: on the CPU the GDN layers size themselves by
      these (pin qwen3_next.py:92-101, qwen3_5.py:145-154; 0.5.23 qwen3_next.py:133-142,
      qwen3_5.py:373-382). The model runner sets them before loading
      (``adjust_config_with_unaligned_cpu_tp``, pin model_runner.py:1326-1329, 0.5.23
      model_runner.py:1301-1304); the parity loader (``runner.load``: ModelConfig +
      get_model) does not run it. With head counts that TP 1 and 2 divide, it sets them to
      the head counts: written here as it would.

    (Its zero-centred norms, used as ``1 + w``, and its gated norm get random weights in
    the common step, ``reference.perturb``: a norm applied with the wrong convention, or
    not at all, shows.)
    """
    text = model.config.get_text_config()
    # SGLang's Qwen3NextConfig (and Qwen3.5's, its subclass) derives the layer types from
    # ``full_attention_interval``, which released configs carry; transformers 5 writes
    # ``layer_types`` only.
    text.full_attention_interval = _INTERVAL
    text.linear_num_key_heads_cpu = text.linear_num_key_heads
    text.linear_num_value_heads_cpu = text.linear_num_value_heads


# SGLang's CPU prefill of a Gated-DeltaNet layer (pin layers/attention/linear/kernels/
# gdn_triton.py:25-28, 0.5.23 :28-30) calls sgl-kernel's chunk_gated_delta_rule_cpu, whose
# Python wrapper (sgl_kernel/mamba.py) passes no eps: the op L2-normalises q and k with its
# default 1e-5 (its schema, as harness/standins/cpu_kernels/gated_delta.py copies it),
# where its decode op, FLA's GPU kernels and transformers (modeling_qwen3_5.py l2norm) use
# 1e-6. That is about 5e-6 relative in each GDN layer's output, which the perturbed
# layers of the tiny models amplify: measured on qwen3_5, the last capture is 2e-4 of
# |ref| off transformers (0.0052 of 25), the tier's default tolerance; with 1e-6 there
# (an experiment, not a patch here) 1.3e-5, transformers' own float32 error. The GDN
# families are compared at 1e-3 of |ref|, far below what a capture bug moves.
_GDN_ATOL = 1e-3

# Where the Gated-DeltaNet layers stop a verify batch on the CPU.
_VERIFY = {
    f"{PIN}:verify": "the pin's MambaPool allocates the verify chain's intermediate states on "
                     "'cuda' whatever its device (mem_cache/memory_pool.py:331, 345), so on the "
                     "CPU its pool holds none and the GDN backend's verify asserts them "
                     "(layers/attention/linear/gdn_backend.py:401)",
    "0.5.23:verify": "the GDN backend's verify hands sgl-kernel's causal_conv1d_update_cpu the "
                     "draft tokens' conv windows to keep (intermediate_conv_window, "
                     "layers/attention/linear/gdn_backend.py:1047), which the harness's CPU "
                     "version of the op (harness/standins/cpu_kernels/gated_delta.py) does not "
                     "implement yet",
}

FAMILIES = [
    Family(
        name="qwen3_next",
        sglang_file="qwen3_next.py",
        hf_config_class="Qwen3NextConfig",
        hf_model_class="Qwen3NextForCausalLM",
        config=_next,
        spec="qwen3_next",
        # At TP 2 with fusion the last layer defers into the final norm at the pin (F):
        # the final hidden states, the logits and the last-layer capture see it.
        also_exercises=frozenset({"F"}),
        defers=True,
        prepare=_prepare,
        attention="harness.parity.hybrid:gdn_backend",
        setup="harness.parity.hybrid:setup",
        atol=_GDN_ATOL,
        cannot_run={**_VERIFY, **IDLE_MOE},
    ),
    Family(
        name="qwen3_5",
        sglang_file="qwen3_5.py",
        hf_config_class="Qwen3_5Config",
        hf_model_class="Qwen3_5ForConditionalGeneration",
        config=lambda: _qwen3_5(moe=False),
        spec="qwen3_5",
        # EAGLE3 goes through the Qwen3-VL wrapper's setter: at the pin it sets the
        # language model's list alone (L); 0.5.23's calls the model's own setter.
        also_exercises_on={"0.5.13.post1": frozenset({"L"})},
        defers=True,
        hf_final_norm="model.language_model.norm",
        prepare=_prepare,
        attention="harness.parity.hybrid:gdn_backend",
        setup="harness.parity.hybrid:setup",
        atol=_GDN_ATOL,
        cannot_run=_VERIFY,
    ),
    Family(
        name="qwen3_5_moe",
        sglang_file="qwen3_5.py",
        hf_config_class="Qwen3_5MoeConfig",
        hf_model_class="Qwen3_5MoeForConditionalGeneration",
        config=lambda: _qwen3_5(moe=True),
        spec="qwen3_5_moe",
        # EAGLE3 goes through the Qwen3-VL wrapper's setter: at the pin it sets the
        # language model's list alone (L); 0.5.23's calls the model's own setter.
        also_exercises_on={"0.5.13.post1": frozenset({"L"})},
        defers=True,
        hf_final_norm="model.language_model.norm",
        prepare=_prepare,
        attention="harness.parity.hybrid:gdn_backend",
        setup="harness.parity.hybrid:setup",
        atol=_GDN_ATOL,
        cannot_run={**_VERIFY, **IDLE_MOE},
    ),
]
