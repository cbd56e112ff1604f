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

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import (
    layer_output,
    mla_standin,
    run_plain,
    running,
    standin_class,
    standins,
)
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models import misc as pin_misc
from harness.standins.models.misc import (
    _apertus_config,
    _arcee_config,
    _exaone_moe_config,
    _granite_config,
    _longcat_config,
)


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


def _granite_run(model, input_ids, positions, forward_batch):
    """The pin's run (the CPU Mamba backend in place) with the batch held for
    :func:`layer_output`."""
    with running(forward_batch):
        return pin_misc._granite_run(model, input_ids, positions, forward_batch)


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
        pin_bugs=frozenset({"B", "C", "R"}),
        fixed_by={"B": "llama-style-aux-packer"},
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
        pin_bugs=frozenset({"B", "C", "U"}),
        fixed_by={"B": "llama-style-aux-packer"},
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
        pin_bugs=frozenset({"B", "C", "R"}),
        fixed_by={"B": "moe-models-aux-packer"},
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
        pin_bugs=frozenset({"B", "C", "R"}),
        fixed_by={"B": "moe-models-aux-packer"},
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
        pin_bugs=frozenset({"B", "C", "U"}),
        fixed_by={"B": "granitemoehybrid-aux-packer"},
        wraps=("granitemoehybrid.py: GraniteMoeHybridForCausalLM",),
        note="no capture setter (dead path, driven by setting layers_to_capture "
        "directly). 0.5.23 scales mixer and FFN outputs by residual_multiplier as the "
        "stages' output transforms and captures at attn_boundary.prepare (the stream): "
        "the pin's double count (X) is gone. The final stream is folded "
        "(residual_batch.fold) and normed without capture: K-1 of K.",
    ),
]
