"""MiniMax M3 on 0.5.23: ``MiniMaxM3Model`` (minimax_m3.py; minimax_m3_vl.py wraps it).

The loop passes ``captured_last_layer_outputs=aux_hidden_states`` to the layers whose
``_is_layer_to_capture`` flag the CausalLM's setters set (pristine minimax_m3.py
1932-1951), and the layer captures through ``attn_boundary.prepare(capture_gathered=...)``
(1814-1818), after the previous layer's owed sum is completed; the last layer's output
is taken through ``residual_batch.final_norm(capture=aux.capture)`` (1955-1965): K of K.
Each decoder layer is an attention stage and an FFN stage on the layer boundaries:
``MiniMaxM3Attention`` (o_proj ``reduce_results=False``) and, per
``config.moe_layer_freq``, a dense ``MiniMaxM3MLP`` (built ``reduce_results=False``)
or a ``MiniMaxM3MoE`` (experts ``reduce_results=False``); the boundaries own every
sum, so every stand-in is REDUCE_NONE. The decoder layer builds its attention through
the class attribute ``attention_cls`` (bound to ``MiniMaxM3Attention`` when the class
is defined), so the stand-in replaces that attribute as well as the module name.
The setters live on the CausalLMs, not on the model: the spec's ``configure`` sets
what ``MiniMaxM3SparseForCausalLM.set_eagle3_layers_to_capture`` sets (capture
indices and the flags of the layers below ``end_layer``), clearing stale flags first.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import layer_output, run_plain, standins

_MODULE = "sglang.srt.models.minimax_m3"


def _config(tc):
    n = tc.num_layers
    return hf_config(
        tc,
        architectures=["MiniMaxM3SparseForCausalLM"],
        # A dense first layer, then MoE layers (moe_layer_freq, minimax_m3.py 1791-1793):
        # both FFN kinds and a dense -> sparse boundary.
        moe_layer_freq=[0] + [1] * (n - 1),
        dense_intermediate_size=tc.intermediate_size,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        scoring_func="sigmoid",
        use_routing_bias=True,
        rotary_dim=tc.hidden_size // 8,
        use_qk_norm=False,
        qk_norm_type="per_layer",
        sparse_attention_config=None,
        use_gemma_norm=False,
    )


def _build_patches(mod):
    items = standins({
        # o_proj RowParallelLinear(reduce_results=False) (pristine minimax_m3.py 816):
        # attn_boundary.finish declares the sum.
        "MiniMaxM3Attention": {},
        # The dense layers' MLP, built with reduce_results=False (1743).
        "MiniMaxM3MLP": {},
        # Routed experts (422) and the shared expert (reduce_results=False, 465):
        # the sum is ffn_boundary.finish's.
        "MiniMaxM3MoE": {},
    })(mod)
    attn = next(value for _, name, value in items if name == "MiniMaxM3Attention")
    return items + [(mod.MiniMaxM3DecoderLayer, "attention_cls", attn)]


def _configure(model, indices):
    """What MiniMaxM3SparseForCausalLM.set_eagle3_layers_to_capture leaves on the
    model for capture indices ``indices`` (its ids + 1): the list, and the flag of each
    listed layer below ``len(layers)``. Stale flags are cleared first (the EAGLE3
    setter never clears them)."""
    for layer in model.layers:
        layer.__dict__.pop("_is_layer_to_capture", None)
    model.layers_to_capture = list(indices)
    for i in model.layers_to_capture:
        if 0 <= i < len(model.layers):
            model.layers[i]._is_layer_to_capture = True


SPECS = [
    ModelSpec(
        name="minimax_m3",
        module=_MODULE,
        model_cls="MiniMaxM3Model",
        standins={},
        build_patches=_build_patches,
        config=_config,
        configure=_configure,
        # The FFN sum is owed past ffn_boundary.finish and completed at the next
        # layer's attn_boundary.prepare (or the final norm) at TP > 1.
        defers=True,
        # B: list + cat. R: the text CausalLM has no DFlash setter (the VL wrapper
        # has one), which the 0.5.23 series leaves alone. T was latent (TBO ungated,
        # pristine 1923; no TBO plan for its layer class): models-capture-skips-tbo's
        # template covers it.
        pin_bugs=frozenset({"B", "R"}),
        fixed_by={"B": "minimax-m3-aux-packer", "R": None},
        layer_output=layer_output,
        run=run_plain,
        wraps=(
            "minimax_m3.py: MiniMaxM3SparseForCausalLM (set_eagle3_layers_to_capture only)",
            "minimax_m3_vl.py: MiniMaxM3SparseForConditionalGeneration "
            "(set_eagle3/dspark/dflash_layers_to_capture)",
        ),
        note="capture_gathered through per-layer _is_layer_to_capture flags at "
        "attn_boundary.prepare (pristine minimax_m3.py 1816, 1932-1951) and the last "
        "layer through residual_batch.final_norm(capture=aux.capture): K of K. "
        "Layer 0 dense, the rest MoE.",
    ),
]
