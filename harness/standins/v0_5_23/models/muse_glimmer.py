"""Muse Glimmer on 0.5.23: ``MuseGlimmerModel`` (muse_glimmer.py; held by
``MuseGlimmerForCausalLM`` and the multimodal ``MuseGlimmerForConditionalGeneration``,
a subclass).

Muse Glimmer does not use the layer boundaries: ``MuseGlimmerDecoderLayer`` threads its
own stream with sandwich norms (``h = x + post_attn_norm(attn(input_layernorm(x)))``,
then ``h + post_ffn_norm(mlp(post_attention_layernorm(h)))``) and returns the layer's
complete output, so the layer output is what it returns. The attention's o_proj and the
MLP's down_proj are ``RowParallelLinear`` with the default ``reduce_results=True``:
the stand-ins are REDUCE_SELF and nothing defers (as gemma3, lfm2).

Stand-ins: ``MuseGlimmerAttention`` (RadixAttention, get_rope, QK norm, the output
gate) and ``MuseGlimmerMLP``. The decoder layers, their four RMSNorms, the scaleless
embedding norm, the embeddings, the model's loop, its capture sites and the final norm
are the real ones.

Captures: DFlash only (``set_dflash_layers_to_capture`` stores its ids as capture
indices, no + 1): index i is the stream entering layer i (420-423 pristine), index
``len(layers)`` the last layer's output after the loop, either side of the final norm
(``post_norm``); pristine 0.5.23 never captures it and its setter refuses the id
(C, fixed by 0004); a plain list (B). The spec sets ``layers_to_capture`` (capture
indices) directly.
"""

from __future__ import annotations

from harness.standins.blocks import REDUCE_SELF
from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import run_plain, standins


def _muse_glimmer_config(tc):
    from sglang.srt.configs.muse_glimmer import MuseGlimmerConfig

    return hf_config(
        tc,
        MuseGlimmerConfig,
        architectures=["MuseGlimmerForCausalLM"],
        sliding_window=4,
        post_norm_eps=1e-6,
        # The checkpoint's scaleless RMSNorm of the token embeddings.
        normalize_tok_embeddings=True,
        output_soft_cap_temp=None,
        # Inside the tiny vocabulary.
        bos_token_id=1,
        eos_token_id=2,
    )


def _layer_output(out):
    """A Muse Glimmer layer's complete output: what it returns (the residual adds are
    inside the layer)."""
    return out


SPECS = [
    ModelSpec(
        name="muse_glimmer",
        module="sglang.srt.models.muse_glimmer",
        model_cls="MuseGlimmerModel",
        standins={},
        build_patches=standins(
            {
                # RadixAttention, get_rope, QK norm and the output gate; o_proj
                # RowParallelLinear with the default reduce_results=True.
                "MuseGlimmerAttention": {},
                # gate_up_proj / down_proj; down_proj reduce_results default True.
                "MuseGlimmerMLP": {},
            },
            reduce=REDUCE_SELF,
        ),
        config=_muse_glimmer_config,
        layer_output=_layer_output,
        run=run_plain,
        # B: list + cat; C: the last layer never captured (its id refused by the
        # setter at start-up). DFlash only (no EAGLE3 setter; the model runner
        # refuses EAGLE3 with one error): not a bug letter.
        pin_bugs=frozenset({"B", "C"}),
        fixed_by={"B": "muse-glimmer-aux-packer"},
        wraps=(
            "muse_glimmer.py: MuseGlimmerForCausalLM (set_dflash_layers_to_capture "
            "only) and MuseGlimmerForConditionalGeneration (its subclass)",
        ),
        note="The stream entering layer i for i in layers_to_capture (pristine "
        "muse_glimmer.py 420-423); nothing after the loop in pristine 0.5.23 "
        "(models-capture-final-layer takes index len(layers) there, "
        "final-layer-capture its post_norm side); a plain list. No layer "
        "boundaries: each attention and MLP all-reduces itself.",
    ),
]
