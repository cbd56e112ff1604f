"""Hybrid Gated-DeltaNet Qwen models: ``Qwen3NextModel`` (qwen3_next.py) and the Qwen3.5
text model ``Qwen3_5ForCausalLM`` (qwen3_5.py, dense ``qwen3_5_text`` and MoE
``qwen3_5_moe_text``).

Layers are chosen by ``config.layers_block_type`` (``full_attention_interval``): a
Gated-DeltaNet linear-attention layer (``linear_attn``), or a full-attention layer whose
attention is computed *inline* by the decoder layer's own ``self_attention`` method
(its own ``qkv_proj`` / ``o_proj`` / ``rotary_emb`` / ``attn``; there is no attention
module class). Both layer types capture through the communicator
(``prepare_attn_and_capture_last_layer_outputs``), driven by per-layer
``_is_layer_to_capture`` flags that the model's ``set_*_layers_to_capture`` setters set
with ``setattr(self.layers[layer_id], ...)`` (IndexError for ``end_layer``: bug C as a
crash). Norms are GemmaRMSNorm. Both layer types defer the MLP all-reduce into the next
layer's fused norm (``_sglang_needs_allreduce_fusion``).

What stands in (GPU compute only):

* the GDN module (``Qwen3GatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``): its ``out_proj`` is
  ``RowParallelLinear(reduce_results=False)`` (qwen3_next.py:213-223,
  qwen3_5.py:267-277) and ``forward`` returns ``out_proj``'s output unreduced
  (qwen3_next.py:457-458, qwen3_5.py:548-549): REDUCE_NONE (the communicator's
  ``prepare_mlp`` all-reduces);
* the inline attention: each full-attention layer's ``self_attention`` is replaced, on
  the layer *instance*, by a stand-in with the method's signature
  ``(positions, hidden_states, forward_batch)``. The real method ends in ``o_proj``,
  ``RowParallelLinear(reduce_results=False)`` (qwen3_next.py:667-676,
  qwen3_5.py:759-768): REDUCE_NONE. The layer's own ``forward`` (communicator, MLP,
  capture) stays real;
* ``get_rope`` (module-level name, only while building): the rotary embedding belongs to
  the inline attention, which stands in, and the CPU ``get_rope`` path is not needed;
* the MLP / MoE: ``Qwen2MoeSparseMoeBlock`` (all-reduces unless
  ``should_skip_post_experts_all_reduce(use_reduce_scatter, should_allreduce_fusion)``,
  qwen2_moe.py:528-539) and ``Qwen2MoeMLP`` (``down_proj(x,
  skip_all_reduce=should_allreduce_fusion or use_reduce_scatter)`` with the default
  ``reduce_results=True``, qwen2_moe.py:180-206): REDUCE_DEFERABLE. The decoder layers
  pick the MLP call form with ``isinstance(layer.mlp, Qwen2MoeSparseMoeBlock)`` looked up
  in the *model's* module at forward time (after the build patches are undone), so the
  MoE stand-in is a subclass of the real ``Qwen2MoeSparseMoeBlock`` (its constructor and
  forward are the stand-in's): the isinstance check picks the MoE call form, as with
  the real block. This matters for qwen3_5, whose calls are positional.
"""

from __future__ import annotations

from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, ModelSpec, hf_config

_QWEN3_NEXT = "sglang.srt.models.qwen3_next"
_QWEN3_5 = "sglang.srt.models.qwen3_5"


# ---------------------------------------------------------------- stand-ins


def _inline_attention_signature():
    import torch

    class InlineSelfAttention(torch.nn.Module):
        """The signature of ``Qwen3HybridAttentionDecoderLayer.self_attention`` /
        ``Qwen3_5AttentionDecoderLayer.self_attention`` (the stand-in binds it)."""

        def __init__(self, prefix: str = "") -> None:  # pragma: no cover - signature only
            super().__init__()

        def forward(self, positions, hidden_states, forward_batch):  # pragma: no cover
            raise NotImplementedError

    return InlineSelfAttention


def _moe_standin(orig_cls, tc):
    """A stand-in for ``Qwen2MoeSparseMoeBlock`` that is also an instance of it."""
    from harness.standins.blocks import standin_class

    base = standin_class(orig_cls, tc, REDUCE_DEFERABLE)
    return type(base.__name__, (base, orig_cls), {"__qualname__": base.__qualname__})


def _no_rope(*args, **kwargs):
    """``get_rope`` while building: the rotary embedding is part of the inline attention,
    which stands in, so it is never called."""
    import torch

    return torch.nn.Identity()


def _construct(cls, config):
    """Builds the real model with the MoE stand-in and ``get_rope`` patched in the model's
    module, then replaces each full-attention layer's inline ``self_attention`` on the
    instance (registered as the submodule ``auxcap_self_attention`` so that it follows
    ``model.to`` and is recognised as a stand-in)."""
    import sys

    from harness.standins.blocks import standin_class
    from harness.standins.models import _patched

    tc = config.auxcap_tiny
    mod = sys.modules[cls.__module__]
    with _patched([
        (mod, "Qwen2MoeSparseMoeBlock", _moe_standin(mod.Qwen2MoeSparseMoeBlock, tc)),
        (mod, "get_rope", _no_rope),
    ]):
        model = cls(config, quant_config=None)
    attn_cls = standin_class(_inline_attention_signature(), tc, REDUCE_NONE)
    for i, layer in enumerate(model.layers):
        if config.layers_block_type[i] != "attention":
            continue
        assert hasattr(type(layer), "self_attention"), type(layer)
        sa = attn_cls(prefix=f"model.layers.{i}.self_attn.self_attention")
        layer.auxcap_self_attention = sa
        # An instance attribute shadows the class's method (a non-data descriptor).
        layer.__dict__["self_attention"] = sa
    return model


def _configure(setter: str):
    def configure(model, indices):
        """Clear every layer's ``_is_layer_to_capture`` (the pin's setters never clear
        stale flags), then call the model's own setter with the already-mapped ids
        (the ForCausalLM / VL wrapper maps ``id + 1``). At the pin its
        ``setattr(self.layers[layer_id], ...)`` raises IndexError for ``end_layer``."""
        for layer in model.layers:
            layer.__dict__.pop("_is_layer_to_capture", None)
        model.layers_to_capture = []
        if indices:
            getattr(model, setter)(list(indices))

    return configure


# ---------------------------------------------------------------- configs


def _hybrid_fields(tc, interval):
    return dict(
        full_attention_interval=interval,
        partial_rotary_factor=0.25,
        attn_output_gate=True,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=tc.intermediate_size,
        shared_expert_intermediate_size=tc.intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _next_config(tc, interval=4):
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    config = hf_config(tc, Qwen3NextConfig, **_hybrid_fields(tc, interval))
    config.auxcap_tiny = tc
    return config


def _qwen3_5_config(tc, moe=False, interval=4):
    from sglang.srt.configs.qwen3_5 import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    cls = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    config = hf_config(tc, cls, **_hybrid_fields(tc, interval))
    config.auxcap_tiny = tc
    return config


# ---------------------------------------------------------------- specs

_NEXT_NOTE = (
    "Layers 3 and 7 are full attention (full_attention_interval=4), the rest Gated "
    "DeltaNet. Neither layer type passes is_last_layer to its LayerCommunicator "
    "(qwen3_next.py:555-560, 726-731), so at TP>1 with all-reduce fusion the last layer "
    "defers its MLP all-reduce (_apply_qwen3_next_mlp sets "
    "_sglang_needs_allreduce_fusion, :493-494) and the final GemmaRMSNorm "
    "(self.norm(hidden_states, residual), :956-960) normalizes a per-rank partial sum: "
    "bug F. Every layer is sparse (Qwen2MoeSparseMoeBlock)."
)

_QWEN3_5_NOTE = (
    "Layers 3 and 7 are full attention (full_attention_interval=4), the rest Gated "
    "DeltaNet. Both layer types pass is_last_layer (qwen3_5.py:623, 828), so the last "
    "layer never defers (no bug F). Deepstack (input_deepstack_embeds, layers 0-2) was "
    "added in place to a layer's hidden_states, this rank's partial sum when the layer "
    "deferred its all-reduce (bug V: tests/multirank/test_deepstack_partial_sums.py). "
    "EAGLE3 at the pin goes through Qwen3VLForConditionalGeneration."
    "set_eagle3_layers_to_capture (qwen3_vl.py:1403-1414), which only assigns "
    "model.layers_to_capture, while the forward captured by per-layer flags (bug L: "
    "zero captures, the wrapper's tuple unpack fails); these specs request captures "
    "through Qwen3_5ForCausalLM.set_dflash_layers_to_capture (qwen3_5.py:1134-1137), "
    "tests/patches/test_capture_by_index.py through the list alone."
)

_GDN_NEXT = {"Qwen3GatedDeltaNet": (REDUCE_NONE, {})}
_GDN_3_5 = {"Qwen3_5GatedDeltaNet": (REDUCE_NONE, {})}

SPECS = [
    ModelSpec(
        name="qwen3_next",
        module=_QWEN3_NEXT,
        model_cls="Qwen3NextModel",
        standins=_GDN_NEXT,
        config=_next_config,
        construct=_construct,
        configure=_configure("set_eagle3_layers_to_capture"),
        defers=True,
        pin_bugs=frozenset({"B", "C", "F", "L"}),
        wraps=("qwen3_next.py: Qwen3NextForCausalLM",),
        note=_NEXT_NOTE,
    ),
    ModelSpec(
        name="qwen3_5",
        module=_QWEN3_5,
        model_cls="Qwen3_5ForCausalLM",
        standins={**_GDN_3_5, "Qwen2MoeMLP": (REDUCE_DEFERABLE, {})},
        config=_qwen3_5_config,
        construct=_construct,
        configure=_configure("set_dflash_layers_to_capture"),
        defers=True,
        pin_bugs=frozenset({"B", "C", "L", "V"}),
        wraps=("qwen3_5.py: Qwen3_5ForConditionalGeneration (via qwen3_vl.py's wrapper)",),
        note=_QWEN3_5_NOTE,
    ),
    ModelSpec(
        name="qwen3_5_moe",
        module=_QWEN3_5,
        model_cls="Qwen3_5MoeForCausalLM",
        standins=_GDN_3_5,
        config=lambda tc: _qwen3_5_config(tc, moe=True),
        construct=_construct,
        configure=_configure("set_dflash_layers_to_capture"),
        defers=True,
        pin_bugs=frozenset({"B", "C", "L", "V"}),
        wraps=("qwen3_5.py: Qwen3_5MoeForConditionalGeneration (Qwen3_5MoeForCausalLM, "
               "via qwen3_vl.py's wrapper)",),
        note=_QWEN3_5_NOTE,
    ),
]
