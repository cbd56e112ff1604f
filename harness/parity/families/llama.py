"""Llama: ``LlamaForCausalLM`` (llama.py; also Phi3, InternLM3, IQuestCoder)."""

from __future__ import annotations

from harness.parity.families import IDLE_ROPE, Family, tiny_fields

FAMILIES = [
    Family(
        name="llama",
        sglang_file="llama.py",
        hf_config_class="LlamaConfig",
        hf_model_class="LlamaForCausalLM",
        config=lambda: tiny_fields(),
        spec="llama",
        cannot_run=IDLE_ROPE,
    ),
]
