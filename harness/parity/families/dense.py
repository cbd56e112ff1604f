"""Apertus, Arcee, GLM-4 and EXAONE-MoE: ``ApertusForCausalLM`` (apertus.py),
``ArceeForCausalLM`` (arcee.py), ``Glm4ForCausalLM`` (glm4.py) and EXAONE-MoE
(exaone_moe.py), against transformers' ``ApertusForCausalLM``, ``ArceeForCausalLM``,
``Glm4ForCausalLM`` and ``ExaoneMoeForCausalLM``.

None of their decoder layers defers its all-reduce (docs/MODELS.md). arcee and glm4
have no capture setter in either base, and only apertus/exaone_moe... have an EAGLE3
one: the model runner refuses what the model cannot set, as the engine does.
"""

from __future__ import annotations

import dataclasses
import functools

from harness.parity.families import (
    BOTH_BASES,
    IDLE_ROPE,
    LONG_WINDOW,
    PIN,
    Family,
    idle_stops,
    tiny_fields,
)

_EXAONE_WINDOW = ("SGLang's exaone_moe.py hands transformers' inclusive sliding_window to "
                  "RadixAttention's exclusive window (pin exaone_moe.py 415-417, 0.5.23 "
                  "390-392): its sliding layers attend one token more than transformers'")
# The triton backend, which SGLang's CPU engine verifies with, takes a sliding window from
# the model runner (its window buffers and indices), which takes it from the model's
# get_attention_sliding_window_size; exaone_moe.py has none (gemma3_causal.py and
# gpt_oss.py do) and is no hybrid-SWA model, so the runner passes None (pin
# model_runner.py:1441-1451, 0.5.23 load_model_utils.py:144-157) and the sliding layers'
# verify forward has no window to read.
_EXAONE_VERIFY = {
    f"{PIN}:verify": "exaone_moe.py has no get_attention_sliding_window_size, so the model "
                     "runner gives the triton backend no window (model_runner.py:1441-1451): "
                     "its sliding layers' verify attention gets no window indices "
                     "(layers/attention/triton_ops/extend_attention.py:618, None)",
    "0.5.23:verify": "exaone_moe.py has no get_attention_sliding_window_size, so the model "
                     "runner gives the triton backend no window (model_runner_components/"
                     "load_model_utils.py:144-157): layers/attention/triton_backend.py:1824 "
                     "asserts the sliding layers' window indices",
}


def _apertus():
    # Real Apertus configs: xIELU MLP (no gate), QK-norm, llama3 rope scaling.
    return tiny_fields(
        hidden_act="xielu",
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0},
    )


def _xielu_bf16(model) -> None:
    """Keep each xIELU's parameters and buffers in bfloat16, the dtype both libraries
    declare them in (``XIELUActivation(dtype=torch.bfloat16)`` in transformers,
    ``XIELU(dtype=torch.bfloat16)`` in SGLang's activation.py, which apertus.py builds
    without a dtype, so SGLang keeps them bfloat16 whatever the model dtype) and what
    real (bfloat16) Apertus checkpoints hold. transformers' float32 load casts them to
    float32, SGLang's does not: softplus(alpha) then differs by a bfloat16 rounding
    (measured: final hidden states 1.9e-3 of 3.7). Cast back, both compute the
    activation's coefficients in bfloat16 and the rest in float32."""
    import torch

    for module in model.modules():
        if type(module).__name__ == "XIELUActivation":
            for name in ("alpha_p", "alpha_n"):
                param = getattr(module, name)
                param.data = param.data.to(torch.bfloat16)
            for name in ("beta", "eps"):
                setattr(module, name, getattr(module, name).to(torch.bfloat16))


def _arcee():
    # Real Arcee (AFM) configs: relu2 MLP (no gate).
    return tiny_fields(hidden_act="relu2")


def _glm4():
    # Real GLM-4-0414 configs: attention bias, partial rotary 0.5, sandwich norms.
    return tiny_fields(attention_bias=True, partial_rotary_factor=0.5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.5})


def _exaone_moe(window: int = LONG_WINDOW):
    # Real K-EXAONE configs: a dense first layer then sigmoid-routed MoE with a shared
    # expert and a correction bias; sliding-window layers with RoPE and global layers
    # without (NoPE), "LLLG".
    #
    # The window (LONG_WINDOW) is longer than the sequences: the sliding layers' masking
    # is left out here, their RoPE (and the global layer's NoPE) stays, so the captures
    # are checked against transformers. ``exaone_moe_window`` (below) keeps a window of
    # 4, where SGLang disagrees: its exaone_moe.py hands transformers' sliding_window to
    # RadixAttention as is (pin exaone_moe.py 415-417, 0.5.23 390-392), but SGLang's
    # window is exclusive of the current token (torch_native_backend.py
    # _make_sliding_window_mask: k_pos >= q_pos - window; gemma2.py/exaone4.py pass
    # sliding_window - 1): it attends sliding_window + 1 tokens, transformers
    # sliding_window (masking_utils.sliding_window_overlay, kv_idx > q_idx -
    # sliding_window). Handing SGLang sliding_window - 1 in config.json makes the
    # window-4 model match to 1e-5, so nothing else differs.
    return tiny_fields(
        sliding_window=window,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        sliding_window_pattern=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def _exaone_moe_json() -> dict:
    # What SGLang's exaone_moe.py reads from config.json that transformers' config does
    # not write: the per-layer MoE flags, and the top-level rope_theta of real K-EXAONE
    # configs (1e6). SGLang reads ``getattr(config, "rope_theta", 1000000)``, which
    # transformers 5 moves into rope_parameters: it takes its default, the same value.
    # The architecture is the name K-EXAONE checkpoints carry and both bases register
    # (the pin knows no other).
    layers = int(_exaone_moe()["num_hidden_layers"])
    return {"architectures": ["ExaoneMoEForCausalLM"],
            "is_moe_layer": [i >= 1 for i in range(layers)], "rope_theta": 1000000.0,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


FAMILIES = [
    Family(
        name="apertus",
        sglang_file="apertus.py",
        hf_config_class="ApertusConfig",
        hf_model_class="ApertusForCausalLM",
        config=_apertus,
        spec="apertus",
        prepare=_xielu_bf16,
        cannot_run=IDLE_ROPE,
    ),
    Family(
        name="arcee",
        sglang_file="arcee.py",
        hf_config_class="ArceeConfig",
        hf_model_class="ArceeForCausalLM",
        config=_arcee,
        spec="arcee",
        cannot_run=IDLE_ROPE,
    ),
    Family(
        name="glm4",
        sglang_file="glm4.py",
        hf_config_class="Glm4Config",
        hf_model_class="Glm4ForCausalLM",
        config=_glm4,
        spec="glm4",
        cannot_run=IDLE_ROPE,
    ),
    Family(
        name="exaone_moe",
        sglang_file="exaone_moe.py",
        hf_config_class="ExaoneMoeConfig",
        hf_model_class="ExaoneMoeForCausalLM",
        config=_exaone_moe,
        spec="exaone_moe",
        config_json=_exaone_moe_json(),
        cannot_run={
            **_EXAONE_VERIFY,
            f"{PIN}:idle": IDLE_ROPE[f"{PIN}:idle"],
            **idle_stops({"0.5.23": "an idle batch stops in SGLang's grouped top-k: "
                                    "biased_grouped_topk_impl views the scores as [0, -1] "
                                    "(layers/moe/topk.py:1797)"}),
        },
    ),
]
# The same model with a window shorter than the prompts: SGLang's sliding layers attend
# one token more than transformers' on both bases (see _exaone_moe).
FAMILIES.append(dataclasses.replace(
    FAMILIES[-1], name="exaone_moe_window", config=functools.partial(_exaone_moe, window=4),
    known_failures={base: _EXAONE_WINDOW for base in BOTH_BASES},
))
