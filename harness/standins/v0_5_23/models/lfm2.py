"""LFM2 and LFM2-MoE on 0.5.23: ``Lfm2Model`` (lfm2.py; lfm2_vl.py wraps its
``Lfm2ForCausalLM``) and ``Lfm2MoeModel`` (lfm2_moe.py).

Neither uses the layer boundaries: a decoder layer threads the stream itself and
returns ``(hidden_states, residual)`` where ``hidden_states`` is already the complete
output (``h = mixer(operator_norm(x)) + x; h = h + feed_forward(ffn_norm(h))``) and
``residual`` the layer's input (pristine lfm2.py 473-500, lfm2_moe.py 480-508), so
:func:`_layer_output` is the first item, not ``hidden_states + residual``. Every
mixer and FFN all-reduces itself (``RowParallelLinear`` out_proj / w2 / down_proj with
the default ``reduce_results=True``; ``FusedMoE(reduce_results=True)``): the stand-ins
are REDUCE_SELF and nothing defers (as gemma3). The final norm (``embedding_norm``)
takes no residual.

Stand-ins: the attention (``Lfm2Attention`` / ``Lfm2MoeAttention``: RadixAttention,
and ``get_rope``, which cannot be built on CPU), the gated short-conv mixer
(``Lfm2ShortConv`` / ``Lfm2MoeShortConv``: GPU compute like attention, the
``causal_conv1d`` kernels over conv state the attention backend's
``conv_state_metadata`` hands out per request), and the FFN (``Lfm2MLP``,
``Lfm2MoeMLP``, ``Lfm2MoeSparseMoeBlock``: FusedMoE / TopK). The decoder layers, both
RMSNorms, the embeddings, the model's loop, capture sites and final norm are the real
ones.

Captures: the layers whose ``_is_layer_to_capture`` flag
``set_dflash_layers_to_capture`` set append their input (index i = input of layer i);
index ``len(layers)`` (the last layer's output) after the loop, either side of the
final norm (``post_norm``); a plain list (B). DFlash only (no EAGLE3 setter; the model
runner refuses EAGLE3 with one error): not a bug letter. The spec's ``configure`` runs
the model's own ``set_dflash_layers_to_capture`` with capture indices (the CausalLM's
setter adds the + 1), clearing the flags first (the setter never clears them).
"""

from __future__ import annotations

from harness.standins.blocks import REDUCE_SELF
from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import run_plain, standins


def _layer_types(n: int) -> list:
    """LFM2's schedule: short-conv layers with a full-attention layer after each pair
    (the 1.2B checkpoint: conv, conv, attention, ...), the last layer attention."""
    types = ["full_attention" if i % 3 == 2 else "conv" for i in range(n)]
    types[-1] = "full_attention"
    return types


def _lfm2_config(tc):
    from sglang.srt.configs.lfm2 import Lfm2Config

    return hf_config(
        tc,
        Lfm2Config,
        architectures=["Lfm2ForCausalLM"],
        layer_types=_layer_types(tc.num_layers),
        norm_eps=1e-6,
        conv_bias=False,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
    )


def _lfm2_moe_config(tc):
    from sglang.srt.configs.lfm2_moe import Lfm2MoeConfig

    return hf_config(
        tc,
        Lfm2MoeConfig,
        architectures=["Lfm2MoeForCausalLM"],
        layer_types=_layer_types(tc.num_layers),
        norm_eps=1e-6,
        conv_bias=False,
        conv_L_cache=3,
        # The checkpoint's: two dense layers, then MoE (a dense -> sparse boundary).
        num_dense_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=tc.intermediate_size,
    )


def _layer_output(out):
    """An LFM2 layer's complete output: the ``hidden_states`` it returns (the residual
    is already added; the second item is the layer's input)."""
    return out[0]


def _configure(model, indices):
    """What ``Lfm2ForCausalLM.set_dflash_layers_to_capture(ids)`` leaves on the model for
    capture indices ``indices`` (its ids + 1), through the model's own setter: the list,
    and the flag of each listed layer below ``len(layers)``. Stale flags are cleared
    first (the setter never clears them)."""
    for layer in model.layers:
        layer._is_layer_to_capture = False
    model.set_dflash_layers_to_capture(list(indices))


def _spec(**kw):
    return ModelSpec(
        standins={},
        configure=_configure,
        layer_output=_layer_output,
        run=run_plain,
        # B: list + cat. DFlash only (no EAGLE3 setter; the model runner refuses
        # EAGLE3 with one error): not a bug letter.
        pin_bugs=frozenset({"B"}),
        fixed_by={"B": "lfm2-aux-packer"},
        # An idle batch: every layer skips IDLE (no capture) and the after-loop
        # capture is gated on a non-idle batch, so the forward returns the bare
        # hidden states, which Lfm2ForCausalLM expects (DFlash skips idle batches).
        idle_captures=False,
        **kw,
    )


SPECS = [
    _spec(
        name="lfm2",
        module="sglang.srt.models.lfm2",
        model_cls="Lfm2Model",
        build_patches=standins(
            {
                # RadixAttention and get_rope; out_proj RowParallelLinear with the
                # default reduce_results=True (lfm2.py 160-166).
                "Lfm2Attention": {},
                # causal_conv1d kernels on the backend's conv state; out_proj
                # RowParallelLinear, reduce_results default True (294-301).
                "Lfm2ShortConv": {},
                # w2: RowParallelLinear, reduce_results default True (100-106).
                "Lfm2MLP": {},
            },
            reduce=REDUCE_SELF,
        ),
        config=_lfm2_config,
        wraps=(
            "lfm2.py: Lfm2ForCausalLM (set_dflash_layers_to_capture only)",
            "lfm2_vl.py: Lfm2VlForConditionalGeneration (language_model is an "
            "Lfm2ForCausalLM)",
        ),
        note="A flagged layer appends its input (pristine lfm2.py 484-485), and "
        "len(layers) is appended after the loop (575-579; final-layer-capture adds "
        "the post_norm side); a plain list; nothing on an idle batch. Attention and short-conv layers (conv, conv, "
        "attention, ...). No layer boundaries: each mixer and FFN all-reduces itself.",
    ),
    _spec(
        name="lfm2_moe",
        module="sglang.srt.models.lfm2_moe",
        model_cls="Lfm2MoeModel",
        build_patches=standins(
            {
                # RadixAttention and get_rope; out_proj RowParallelLinear, default
                # reduce_results=True.
                "Lfm2MoeAttention": {},
                # causal_conv1d / fused LFM short-conv kernels on the backend's conv
                # state; out_proj RowParallelLinear, default reduce_results=True.
                "Lfm2MoeShortConv": {},
                # The dense layers' MLP: down_proj RowParallelLinear, default
                # reduce_results=True.
                "Lfm2MoeMLP": {},
                # Router, TopK and FusedMoE(reduce_results=True) (lfm2_moe.py 161).
                "Lfm2MoeSparseMoeBlock": {},
            },
            reduce=REDUCE_SELF,
        ),
        config=_lfm2_moe_config,
        wraps=("lfm2_moe.py: Lfm2MoeForCausalLM (set_dflash_layers_to_capture only)",),
        note="As lfm2 (pristine lfm2_moe.py 491-492, 580-589): a plain list. Layers "
        "0-1 dense, the rest MoE; no layer boundaries.",
    ),
]
