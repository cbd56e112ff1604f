"""Gemma 3 and Gemma 4 text models on 0.5.23: ``Gemma3TextModel`` (gemma3_causal.py)
and ``Gemma4TextModel`` (gemma4_causal.py).

They differ on this base:

* gemma3 does not use the layer boundaries: its layers thread ``(hidden_states,
  residual)`` and return the FFN's normed output and the residual separately
  (gemma3_causal.py 369-412); the model appends the *returned ``hidden_states``* at the
  top of the loop and after it (653-672), which is only the last FFN's contribution,
  not the stream, and which the next in-place ``Gemma3RMSNorm(h, residual)`` (CUDA
  ``gemma_fused_add_rmsnorm``, 1342-1348) then overwrites. The complete output of a
  layer is ``hidden_states + residual`` (the pin's default ``layer_output``). Its
  o_proj / down_proj all-reduce themselves (``reduce_results`` default True): the
  stand-ins are REDUCE_SELF, and nothing defers.
* gemma4 uses the boundaries; its FFN writes the whole stream at its exit
  (``REPLACE_AT_EXIT``) and the model captures at ``attn_boundary.prepare`` and the
  final layer after the loop (1059-1094): K of K.
"""

from __future__ import annotations

import functools

from harness.standins.blocks import REDUCE_SELF
from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.gemma import _gemma3_config, _gemma4_config, _gemma4_construct


# ---------------------------------------------------------------- gemma3


def _gemma3_cpu_norm(norm, x, residual=None):
    """``Gemma3RMSNorm`` with the CUDA kernels' aliasing: with a residual,
    ``gemma_fused_add_rmsnorm`` is in place (``residual += x; x = norm(residual)``);
    without, ``gemma_rmsnorm`` is out of place. Weight ``1 + w``."""
    from harness.standins.kernels import _rms

    weight = 1.0 + norm.weight.data
    if x.shape[0] == 0:
        return x if residual is None else (x, residual)
    if residual is None:
        return _rms(x, weight, norm.eps)
    residual.add_(x)
    x.copy_(_rms(residual, weight, norm.eps))
    return x, residual


def _gemma3_construct(cls, config):
    """The real constructor; then each attention stand-in (and its layer) gets the real
    ``is_sliding`` of its layer, which the decoder reads to pick the RoPE tables; and
    off CUDA every ``Gemma3RMSNorm`` (not an RMSNorm: ``install_cpu_norm`` skips it)
    gets the in-place CPU version of its CUDA kernel."""
    from sglang.srt.layers.layernorm import Gemma3RMSNorm

    from harness.standins.kernels import has_real_kernels

    model = cls(config, quant_config=None)
    for i, layer in enumerate(model.layers):
        layer.self_attn.is_sliding = layer.is_sliding = (
            config.layer_types[i] == "sliding_attention"
        )
    if not has_real_kernels():
        for sub in model.modules():
            if isinstance(sub, Gemma3RMSNorm):
                sub._forward_method = functools.partial(_gemma3_cpu_norm, sub)
    return model


def _hidden_plus_residual(out):
    """A gemma3 layer's complete output: ``hidden_states + residual``."""
    h, r = out
    return h if r is None else h + r


def _gemma3_run(model, input_ids, positions, forward_batch):
    return model(input_ids, positions, forward_batch)


SPECS = [
    ModelSpec(
        name="gemma3",
        module="sglang.srt.models.gemma3_causal",
        model_cls="Gemma3TextModel",
        standins={},
        build_patches=standins(
            {
                # get_rope cannot be built on CPU. o_proj: RowParallelLinear with the
                # default reduce_results=True (gemma3_causal.py 177-183). The decoder
                # reads self_attn.is_sliding.
                "Gemma3Attention": {"is_sliding": False},
                # down_proj: RowParallelLinear, reduce_results default True (91-106).
                "Gemma3MLP": {},
            },
            reduce=REDUCE_SELF,
        ),
        config=_gemma3_config,
        construct=_gemma3_construct,
        layer_output=_hidden_plus_residual,
        run=_gemma3_run,
        pin_bugs=frozenset({"B", "E", "X", "R"}),
        fixed_by={"B": "gemma3-aux-packer"},
        wraps=(
            "gemma3_causal.py: Gemma3ForCausalLM",
            "gemma3_mm.py: Gemma3ForConditionalGeneration (via Gemma3ForCausalLM)",
        ),
        note="0.5.23 gemma3 threads (hidden_states, residual) itself (no layer "
        "boundaries) and captures the returned hidden_states (the FFN's contribution, "
        "not the stream) at the top of the loop and for num_layers after it "
        "(gemma3_causal.py 653-672), without a clone: the next in-place "
        "Gemma3RMSNorm(h, residual) overwrites it (X, E). No "
        "set_dflash_layers_to_capture.",
    ),
    ModelSpec(
        name="gemma4",
        module="sglang.srt.models.gemma4_causal",
        model_cls="Gemma4TextModel",
        standins={},
        build_patches=standins({
            # get_rope cannot be built on CPU. o_proj reduce_results=False (372).
            "Gemma4Attention": {},
            # Gemma4MLP and Gemma4MoE built with reduce_results=False (599, 653); each
            # part's sum is completed by ffn_boundary.sum_part before its post-FFN norm.
            "Gemma4MLP": {},
            "Gemma4MoE": {},
        }),
        config=_gemma4_config,
        construct=_gemma4_construct,
        layer_output=layer_output,
        run=run_plain,
        pin_bugs=frozenset({"B"}),
        fixed_by={"B": "gemma4-aux-packer"},
        wraps=(
            "gemma4_causal.py: Gemma4ForCausalLM",
            "gemma4_mm.py: Gemma4ForConditionalGeneration (language_model is a "
            "Gemma4TextModel)",
        ),
        note="Captures at attn_boundary.prepare (the stream the previous FFN wrote at "
        "its exit, REPLACE_AT_EXIT) and the final layer after the loop "
        "(gemma4_causal.py 1059-1094): K of K; the pin's aliasing (E) is gone.",
    ),
]
