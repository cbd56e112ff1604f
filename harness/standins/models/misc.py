"""Models without a deferred all-reduce, one spec each.

``ApertusModel`` (apertus.py), ``ArceeModel`` (arcee.py), ``ExaoneMoEModel``
(exaone_moe.py), ``LongcatFlashModel`` (longcat_flash.py) and
``GraniteMoeHybridModel`` (granitemoehybrid.py). All capture at the top of the layer
loop with ``hidden_states + residual`` into a list; none defers its MLP all-reduce.
"""

from __future__ import annotations

from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, REDUCE_SELF, ModelSpec, hf_config

# ---------------------------------------------------------------- apertus


def _apertus_config(tc):
    from transformers import ApertusConfig

    # ApertusDecoderLayer reads config.rope_parameters["rope_theta"] (v5 style) and
    # ApertusMLP accepts only hidden_act "xielu" (the MLP stands in; kept realistic).
    return hf_config(tc, ApertusConfig, hidden_act="xielu")


# ---------------------------------------------------------------- arcee


def _arcee_config(tc):
    from transformers import ArceeConfig

    # ArceeMLP accepts only hidden_act "relu2"; rope_parameters["rope_theta"] is read.
    return hf_config(tc, ArceeConfig, hidden_act="relu2")


# ---------------------------------------------------------------- exaone_moe


def _exaone_moe_config(tc):
    n = tc.num_layers
    return hf_config(
        tc,
        # Per-layer lists: layer 0 dense (ExaoneMoEMLP), the rest sparse
        # (ExaoneMoESparseMoEBlock); three sliding-window layers per full one.
        is_moe_layer=[i >= 1 for i in range(n)],
        layer_types=["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)],
        sliding_window=128,
        num_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        num_shared_experts=1,
        moe_intermediate_size=tc.intermediate_size,
        norm_topk_prob=True,
    )


# ---------------------------------------------------------------- longcat_flash


def _longcat_config(tc):
    from sglang.srt.configs import LongcatFlashConfig

    config = hf_config(
        tc,
        LongcatFlashConfig,
        num_hidden_layers=tc.num_layers,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=4,
        moe_topk=2,
        expert_ffn_hidden_size=tc.intermediate_size,
        routed_scaling_factor=1.0,
        zero_expert_num=2,
        zero_expert_type="identity",
        torch_dtype="float32",
        params_dtype="float32",
    )
    # LongcatFlashConfig assigns ``self.rope_scaling = rope_scaling`` after
    # PretrainedConfig.__init__, which in transformers v5 clears rope_parameters;
    # the decoder layer reads config.rope_parameters["rope_theta"] (longcat_flash.py:332).
    config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}
    return config


def _longcat_build_patches(mod):
    import torch

    # LongcatFlashModel.__init__ runs ``self.alt_stream = torch.cuda.Stream()``
    # unconditionally (longcat_flash.py:521); only the (stood-in) MLA attentions
    # receive it, so None is enough on CPU.
    return [(torch.cuda, "Stream", lambda *a, **k: None)]


# ---------------------------------------------------------------- granitemoehybrid

_GRANITE_LAYER_TYPES = ("attention", "mamba")


def _granite_config(tc):
    from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridConfig

    n = tc.num_layers
    return hf_config(
        tc,
        GraniteMoeHybridConfig,
        # Both layer kinds: the mamba mixer stands in (see _granite_run); the
        # real GraniteMoeHybridMambaDecoderLayer.forward runs.
        layer_types=[_GRANITE_LAYER_TYPES[i % 3 == 1] for i in range(n)],
        position_embedding_type="rope",
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_heads=4,
        mamba_d_head=tc.hidden_size * 2 // 4,
        mamba_n_groups=1,
        # Exact binary fractions keep every value exact at every TP size.
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.25,
        logits_scaling=1.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=tc.intermediate_size,
    )


_FAKE_BACKEND = None


def _granite_backend():
    """A real ``HybridLinearAttnBackend`` / ``Mamba2AttnBackend`` pair (made without
    their constructors) whose linear-attention ``forward`` runs the stood-in mixer
    and writes ``output`` as ``Mamba2AttnBackend.forward`` does; it passes the
    mamba layer's isinstance asserts (granitemoehybrid.py:142-143)."""
    global _FAKE_BACKEND
    if _FAKE_BACKEND is None:
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
            HybridLinearAttnBackend,
            Mamba2AttnBackend,
        )

        linear = Mamba2AttnBackend.__new__(Mamba2AttnBackend)

        def forward(mixer, hidden_states, output, layer_id, forward_batch,
                    mup_vector=None, use_triton_causal_conv=False):
            mixer_out = mixer(hidden_states=hidden_states, output=output,
                              forward_batch=forward_batch)
            if output is not None:
                output[: mixer_out.shape[0]].copy_(mixer_out)
            return mixer_out

        linear.forward = forward
        hybrid = HybridLinearAttnBackend.__new__(HybridLinearAttnBackend)
        hybrid.linear_attn_backend = linear
        _FAKE_BACKEND = hybrid
    return _FAKE_BACKEND


def _granite_run(model, input_ids, positions, forward_batch):
    import importlib
    import sys

    # The module of the model's class (or of the first base that is granite's): the
    # memory suite also runs a pristine copy of the file under a module name of its
    # own (harness.memory.models.pin_module), whose get_attn_backend is its own.
    mod = next((sys.modules[c.__module__] for c in type(model).__mro__
                if hasattr(sys.modules.get(c.__module__), "get_attn_backend")),
               None) or importlib.import_module("sglang.srt.models.granitemoehybrid")
    saved = mod.get_attn_backend
    backend = _granite_backend()
    mod.get_attn_backend = lambda: backend
    try:
        return model(input_ids, positions, forward_batch)
    finally:
        mod.get_attn_backend = saved


def _granite_layer_output(out):
    # Each granite layer ignores the incoming residual (``residual = hidden_states``,
    # granitemoehybrid.py:139, 326) and returns the full stream as hidden_states
    # (``residual + mlp_out * residual_multiplier``); the returned residual is the
    # post-attention stream. The complete output is hidden_states alone.
    return out[0]


# ---------------------------------------------------------------- specs

SPECS = [
    ModelSpec(
        name="apertus",
        module="sglang.srt.models.apertus",
        model_cls="ApertusModel",
        standins={
            # o_proj: RowParallelLinear, default reduce_results=True (apertus.py:168-174).
            "ApertusAttention": (REDUCE_SELF, {}),
            # down_proj: reduce_results=True, skip_all_reduce=use_reduce_scatter
            # (apertus.py:81-88, 106-109); the layer never passes use_reduce_scatter.
            "ApertusMLP": (REDUCE_DEFERABLE, {}),
        },
        config=_apertus_config,
        pin_bugs=frozenset({"B", "C", "R"}),
        wraps=("apertus.py: ApertusForCausalLM",),
        note="norms are attention_layernorm / feedforward_layernorm; "
        "forward_split_prefill never captures",
    ),
    ModelSpec(
        name="arcee",
        module="sglang.srt.models.arcee",
        model_cls="ArceeModel",
        standins={
            # o_proj: RowParallelLinear, default reduce_results=True (arcee.py:152-158).
            "ArceeAttention": (REDUCE_SELF, {}),
            # down_proj: RowParallelLinear(reduce_results=True) (arcee.py:80-87).
            "ArceeMLP": (REDUCE_SELF, {}),
        },
        config=_arcee_config,
        # Dead at the pin: no set_eagle3/dflash_layers_to_capture, so nothing ever
        # sets layers_to_capture; the harness sets it directly (default configure).
        pin_bugs=frozenset({"B", "C", "U"}),
        wraps=("arcee.py: ArceeForCausalLM",),
        note="no capture setter at the pin: the capture path is dead code "
        "(EAGLE3 AttributeError, DFlash ValueError); driven by setting "
        "layers_to_capture directly",
    ),
    ModelSpec(
        name="exaone_moe",
        module="sglang.srt.models.exaone_moe",
        model_cls="ExaoneMoEModel",
        standins={
            # o_proj: RowParallelLinear, default reduce_results=True (exaone_moe.py:377-385).
            "ExaoneMoEAttention": (REDUCE_SELF, {}),
            # dense: down_proj reduce_results=True with skip_all_reduce=
            # should_allreduce_fusion or use_reduce_scatter (exaone_moe.py:106-133);
            # the layer calls self.mlp(hidden_states).
            "ExaoneMoEMLP": (REDUCE_DEFERABLE, {}),
            # all-reduces unless should_skip_post_experts_all_reduce(use_reduce_scatter)
            # (exaone_moe.py:306-310); never passed.
            "ExaoneMoESparseMoEBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_exaone_moe_config,
        pin_bugs=frozenset({"B", "C", "R"}),
        wraps=("exaone_moe.py: ExaoneMoEForCausalLM",),
        note="forward_split_prefill never captures; exaone_moe_mtp.py builds an "
        "ExaoneMoEModel as its MTP draft (not a capturing target)",
    ),
    ModelSpec(
        name="longcat_flash",
        module="sglang.srt.models.longcat_flash",
        model_cls="LongcatFlashModel",
        standins={
            # DeepseekV2AttentionMLA(reduce_results=False) (longcat_flash.py:341);
            # the communicators' prepare_mlp all-reduce.
            "DeepseekV2AttentionMLA": (REDUCE_NONE, {}),
            # LongcatFlashMLP: down_proj reduce_results=False (default, 136, 147-154);
            # the layer all-reduces explicitly (463, 483).
            "LongcatFlashMLP": (REDUCE_NONE, {}),
            # LongcatFlashMoE.forward all-reduces when tp_size > 1 (290-291); standing
            # in also avoids zero_experts_compute_triton (274-281).
            "LongcatFlashMoE": (REDUCE_SELF, {}),
        },
        config=_longcat_config,
        build_patches=_longcat_build_patches,
        pin_bugs=frozenset({"B", "C", "R"}),
        wraps=("longcat_flash.py: LongcatFlashForCausalLM",),
        note="no PP: loops over len(self.layers); each layer = 2 MLA attentions, "
        "2 dense MLPs (explicit all-reduce) and a self-reducing MoE",
    ),
    ModelSpec(
        name="granitemoehybrid",
        module="sglang.srt.models.granitemoehybrid",
        model_cls="GraniteMoeHybridModel",
        standins={
            # o_proj: RowParallelLinear, default reduce_results=True (granitemoehybrid.py:218-224).
            "GraniteMoeHybridAttention": (REDUCE_SELF, {}),
            # FusedMoE(reduce_results=True) inside (granitemoe.py:70-77).
            "GraniteMoeMoE": (REDUCE_SELF, {}),
            # output_linear: RowParallelLinear, default reduce_results=True (57-63).
            "GraniteMoeSharedMLP": (REDUCE_SELF, {}),
            # out_proj: RowParallelLinear, default reduce_results=True (mamba.py:409-416);
            # its kernels run through the linear-attention backend (see _granite_run).
            "MambaMixer2": (REDUCE_SELF, {}),
        },
        config=_granite_config,
        layer_output=_granite_layer_output,
        run=_granite_run,
        # Dead at the pin (no setter), and its top-of-loop hidden_states + residual
        # double-counts (the layers return the full stream as hidden_states): "X".
        pin_bugs=frozenset({"B", "C", "X", "U", "N"}),
        wraps=("granitemoehybrid.py: GraniteMoeHybridForCausalLM",),
        note="no capture setter at the pin (dead path, driven by setting "
        "layers_to_capture directly); its capture expression hidden_states + residual "
        "is wrong: layers return the full stream as hidden_states, so it captures "
        "stream + post-attention stream; the final norm likewise computes "
        "norm(h + r) where HF applies norm(h) (pre-existing, outside capture)",
    ),
]
