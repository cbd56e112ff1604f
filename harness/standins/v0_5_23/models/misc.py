"""Other capturing models on 0.5.23, one spec each.

``ApertusModel`` (apertus.py), ``ArceeModel`` (arcee.py), ``ExaoneMoEModel``
(exaone_moe.py), ``LongcatFlashModel`` (longcat_flash.py) and
``GraniteMoeHybridModel`` (granitemoehybrid.py). All build their attention / mixer and
MLP / MoE with ``reduce_results=False`` on this base (the stage boundaries own every
sum), so every stand-in is REDUCE_NONE; every FFN but granitemoehybrid's (output
transforms, unfused norm reads) defers its sum to the next layer's
``attn_boundary.prepare`` at TP > 1.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_plain,
    running,
    standin_class,
    standins,
)

# ---------------------------------------------------------------- configs (as the pin's)


def _apertus_config(tc):
    from transformers import ApertusConfig

    # ApertusMLP accepts only hidden_act "xielu" (the MLP stands in; kept realistic).
    return hf_config(tc, ApertusConfig, hidden_act="xielu")


def _arcee_config(tc):
    from transformers import ArceeConfig

    # ArceeMLP accepts only hidden_act "relu2".
    return hf_config(tc, ArceeConfig, hidden_act="relu2")


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
    # The decoder layer reads config.rope_parameters["rope_theta"].
    config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default"}
    return config


def _longcat_patches(mod):
    from harness.standins.blocks import TinyConfig

    tc = TinyConfig()
    return [
        # Two MLA attentions per layer, reduce_results=False (longcat_flash.py 388);
        # the boundaries take prepare_qkv_latent as their qkv_latent_func.
        (mod, "DeepseekV2AttentionMLA", mla_standin(mod.DeepseekV2AttentionMLA, tc)),
        # Two dense MLPs per layer, reduce_results=False (414).
        (mod, "LongcatFlashMLP", standin_class(mod.LongcatFlashMLP, tc, {})),
        # The MoE runs as a branch (moe_boundary.branch_output / merge_branch,
        # 474-502); its experts' sum is the boundary's. Standing in also avoids
        # zero_experts_compute_triton.
        (mod, "LongcatFlashMoE", standin_class(mod.LongcatFlashMoE, tc, {})),
    ]


_GRANITE_LAYER_TYPES = ("attention", "mamba")


def _granite_config(tc):
    from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridConfig

    n = tc.num_layers
    return hf_config(
        tc,
        GraniteMoeHybridConfig,
        # Both layer kinds: the mamba mixer stands in (see _granite_run); the real
        # GraniteMoeHybridMambaDecoderLayer.forward runs.
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
    their constructors) whose linear-attention ``forward`` runs the stood-in mixer and
    writes ``output`` as ``Mamba2AttnBackend.forward`` does; it passes the mamba layer's
    isinstance asserts (granitemoehybrid.py 147-149)."""
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

    mod = importlib.import_module("sglang.srt.models.granitemoehybrid")
    saved = mod.get_attn_backend
    backend = _granite_backend()
    mod.get_attn_backend = lambda: backend
    try:
        with running(forward_batch):
            return model(input_ids, positions, forward_batch)
    finally:
        mod.get_attn_backend = saved


def _spec(**kw):
    kw.setdefault("standins", {})
    kw.setdefault("defers", True)
    kw.setdefault("layer_output", layer_output)
    kw.setdefault("run", run_plain)
    return ModelSpec(**kw)


SPECS = [
    _spec(
        name="apertus",
        module="sglang.srt.models.apertus",
        model_cls="ApertusModel",
        # o_proj reduce_results=False (apertus.py 172); ApertusMLP built with
        # reduce_results=False (263).
        build_patches=standins({"ApertusAttention": {}, "ApertusMLP": {}}),
        config=_apertus_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("apertus.py: ApertusForCausalLM",),
        note="capture_output at attn_boundary.prepare (apertus.py 366-374); final_norm "
        "without capture: K-1 of K. forward_split_prefill never captures.",
    ),
    _spec(
        name="arcee",
        module="sglang.srt.models.arcee",
        model_cls="ArceeModel",
        # o_proj reduce_results=False (arcee.py 160); ArceeMLP reduce_results=False (239).
        build_patches=standins({"ArceeAttention": {}, "ArceeMLP": {}}),
        config=_arcee_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("arcee.py: ArceeForCausalLM",),
        note="no capture setter: the capture path is dead code; driven by setting "
        "layers_to_capture directly (capture_output at attn_boundary.prepare, 340-354).",
    ),
    _spec(
        name="exaone_moe",
        module="sglang.srt.models.exaone_moe",
        model_cls="ExaoneMoEModel",
        build_patches=standins({
            # o_proj reduce_results=False (exaone_moe.py 358).
            "ExaoneMoEAttention": {"qkv_proj": None},
            # Dense layer 0: reduce_results=False (481); the MoE block leaves its
            # experts' (and shared experts', 196) sum to ffn_boundary.finish.
            "ExaoneMoEMLP": {"gate_up_proj": None},
            "ExaoneMoESparseMoEBlock": {},
        }),
        config=_exaone_moe_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("exaone_moe.py: ExaoneMoEForCausalLM",),
        note="capture_output at attn_boundary.prepare (exaone_moe.py 599-617); K-1 of "
        "K. forward_split_prefill never captures.",
    ),
    _spec(
        name="longcat_flash",
        module="sglang.srt.models.longcat_flash",
        model_cls="LongcatFlashModel",
        build_patches=_longcat_patches,
        config=_longcat_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("longcat_flash.py: LongcatFlashForCausalLM",),
        note="Captures residual_batch.snapshot(hidden_states) at the top of the loop "
        "for i in layers_to_capture (longcat_flash.py 617-623): the same function the "
        "reference (layer_output) uses, at the same point (between layers), so here "
        "the reference is independent only of the TP > 1 completion (it is taken at "
        "TP = 1). No capture after the loop: K-1 of K. Each layer = 2 MLA attentions, "
        "2 dense MLPs and a MoE branch.",
    ),
    _spec(
        name="granitemoehybrid",
        module="sglang.srt.models.granitemoehybrid",
        model_cls="GraniteMoeHybridModel",
        build_patches=standins({
            # o_proj reduce_results=False (granitemoehybrid.py 223).
            "GraniteMoeHybridAttention": {},
            # granitemoe's, imported into granitemoehybrid, both built with
            # reduce_results=False (303, 313 and 112, 122).
            "GraniteMoeMoE": {},
            "GraniteMoeSharedMLP": {},
            # reduce_results=False (98); its kernels run through the linear-attention
            # backend (see _granite_run).
            "MambaMixer2": {},
        }),
        config=_granite_config,
        run=_granite_run,
        # UNFUSED_NORM_READOUT reads and residual_multiplier output transforms: every
        # sum completes at its exit, no fusion candidate is bound (checked at TP 2).
        defers=False,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("granitemoehybrid.py: GraniteMoeHybridForCausalLM",),
        note="no capture setter (dead path, driven by setting layers_to_capture "
        "directly). 0.5.23 scales mixer and FFN outputs by residual_multiplier as the "
        "stages' output transforms and captures at attn_boundary.prepare (the stream): "
        "the pin's double count (X) is gone. The final stream is folded "
        "(residual_batch.fold) and normed without capture: K-1 of K.",
    ),
]
