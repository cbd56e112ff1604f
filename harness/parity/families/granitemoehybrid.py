"""GraniteMoeHybrid: ``GraniteMoeHybridForCausalLM`` (granitemoehybrid.py: Mamba2 and
attention decoder layers, each with a MoE and a shared MLP; the Granite-4.0-H models);
transformers' ``GraniteMoeHybridForCausalLM``.

The mamba layers run SGLang's own ``MambaMixer2`` through its ``Mamba2AttnBackend`` over
a ``MambaPool``, the attention layers ``torch_native`` over a ``HybridLinearKVPool``,
both behind a ``HybridLinearAttnBackend`` (:mod:`harness.parity.mamba`, the family's
``attention`` and ``setup`` hooks). The mixer's two GPU kernels (the Triton causal conv
and the SSD scan) have no CPU path: pure-torch versions stand in
(:mod:`harness.standins.cpu_kernels.mamba2`).

Known at the pin (0001-0010): the final ``self.norm(hidden_states, residual)`` adds the
post-attention stream to the whole stream (pin granitemoehybrid.py 457; HF and 0.5.23
apply ``norm(hidden_states)``), so the final hidden states and logits differ from
transformers; the model has no capture setter (the model runner refuses EAGLE3 and
DFlash).
"""

from __future__ import annotations

from harness.parity.families import PIN, Family, idle_stops, tiny_fields

# The released Granite-4.0-H checkpoints name the layer kinds "mamba" / "attention";
# transformers >= 5.15 renames them to "linear_attention" / "full_attention" on load
# and writes those (SGLang 0.5.23 maps them back, the pin's config refuses them).
_LAYER_TYPES = ["mamba", "attention", "mamba", "mamba"]


def _config():
    return tiny_fields(
        num_hidden_layers=len(_LAYER_TYPES),
        layer_types=list(_LAYER_TYPES),
        intermediate_size=32,  # per expert
        shared_intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="nope",  # as the Granite-4.0-H checkpoints
        # Mamba2: 8 heads of 16 (expand 2 x hidden 64), one group (every released
        # checkpoint: at TP 2 SGLang replicates it to both head shards), chunk 256.
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        # Granite's multipliers, all different from 1 so that each is seen to apply.
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.25,
        logits_scaling=6.0,
        tie_word_embeddings=True,
    )


# Where the Mamba2 layers stop the later forwards on the CPU. The decode batch: the mixer's
# decode conv update (causal_conv1d_update_triton) is bound only on CUDA, NPU and XPU
# (layers/attention/mamba/mamba.py: pin 42-74, 0.5.23 43-75), and the harness's CPU
# versions cover the extend's ops only (harness/standins/cpu_kernels/mamba2.py). The
# verify batch's prefix holds the decode token. The idle batch: the model runner clears
# the hybrid backend's forward metadata for an idle batch (forward_idle), not its Mamba2
# backend's, so the mixer reads the previous batch's token count and asserts it.
_CANNOT_RUN = {
    f"{PIN}:decode": "the Mamba2 mixer's decode conv update, causal_conv1d_update_triton, is "
                     "bound only on CUDA/NPU/XPU: NameError at "
                     "layers/attention/mamba/mamba.py:655",
    "0.5.23:decode": "the Mamba2 mixer's decode conv update, causal_conv1d_update_triton, is "
                     "bound only on CUDA/NPU/XPU: NameError at "
                     "layers/attention/mamba/mamba.py:693",
    **{f"{base}:verify": "its prefix holds the decode token, whose forward cannot run on the "
                         "CPU (see the decode case)" for base in (PIN, "0.5.23")},
    **idle_stops({
        PIN: "an idle batch leaves the Mamba2 backend's metadata of the previous batch "
             "(forward_idle clears the hybrid backend's only): MambaMixer2.forward asserts "
             "its token count (layers/attention/mamba/mamba.py:491)",
        "0.5.23": "an idle batch leaves the Mamba2 backend's metadata of the previous batch "
                  "(forward_idle clears the hybrid backend's only): MambaMixer2.forward "
                  "asserts its token count (layers/attention/mamba/mamba.py:520)",
    }),
}

FAMILIES = [
    Family(
        name="granitemoehybrid",
        sglang_file="granitemoehybrid.py",
        hf_config_class="GraniteMoeHybridConfig",
        hf_model_class="GraniteMoeHybridForCausalLM",
        config=_config,
        spec="granitemoehybrid",
        config_json={"layer_types": list(_LAYER_TYPES)},
        attention="harness.parity.mamba:backend",
        setup="harness.parity.mamba:setup",
        cannot_run=_CANNOT_RUN,
    ),
]
