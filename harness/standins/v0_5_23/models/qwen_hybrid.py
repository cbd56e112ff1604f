"""Hybrid Gated-DeltaNet Qwen models on 0.5.23: ``Qwen3NextModel`` (qwen3_next.py) and
the Qwen3.5 text models ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (qwen3_5.py).

Layers are chosen by ``config.layers_block_type``: a Gated-DeltaNet layer
(``linear_attn``) or a full-attention layer whose attention is computed inline by its
own ``self_attention`` method (no attention module class). Both capture through
``attn_boundary.prepare(capture_gathered=...)`` for layers with
``_is_layer_to_capture``, which the models' ``set_*_layers_to_capture`` set with
``setattr(self.layers[layer_id], ...)``: IndexError for ``end_layer``. Norms are
GemmaRMSNorm. Every FFN leaves its sum to the next layer's ``attn_boundary.prepare``
(the pin's bug F, qwen3_next's last layer deferring into the final norm, is gone: the
terminal stage completes at its exit).

What stands in (GPU compute only), all REDUCE_NONE (every original is built with
``reduce_results=False``; the boundaries own every sum):

* the GDN module (``Qwen3GatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``; qwen3_5's layer
  reads ``linear_attn.in_proj_qkvz`` at construction);
* the inline attention: each full-attention layer's ``self_attention`` is replaced on
  the layer *instance* by a stand-in with the method's signature
  ``(positions, hidden_states, forward_batch)`` (the real one ends in ``o_proj``,
  ``reduce_results=False``); ``get_rope`` while building (its rotary embedding belongs
  to the inline attention);
* the MLP / MoE: ``Qwen2MoeSparseMoeBlock`` (a subclass of the real class: the layers
  pick the call form with ``isinstance(layer.mlp, Qwen2MoeSparseMoeBlock)`` at forward
  time) and qwen3_5's dense ``Qwen2MoeMLP`` (``_maybe_enable_silu_fp4_quant_fusion``
  reads ``gate_up_proj.quant_method`` / ``down_proj.quant_method``).
"""

from __future__ import annotations

from types import SimpleNamespace

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standin_class
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.qwen_hybrid import (
    _inline_attention_signature,
    _next_config,
    _no_rope,
    _qwen3_5_config,
)

_QWEN3_NEXT = "sglang.srt.models.qwen3_next"
_QWEN3_5 = "sglang.srt.models.qwen3_5"


def _moe_standin(orig_cls, tc):
    """A stand-in for ``Qwen2MoeSparseMoeBlock`` that is also an instance of it."""
    base = standin_class(orig_cls, tc, {})
    return type(base.__name__, (base, orig_cls), {"__qualname__": base.__qualname__})


def _no_quant():
    return SimpleNamespace(quant_method=None)


def _construct(cls, config):
    """Builds the real model with the stand-ins and ``get_rope`` patched in the model's
    module, then replaces each full-attention layer's inline ``self_attention`` on the
    instance (registered as the submodule ``auxcap_self_attention`` so that it follows
    ``model.to`` and is recognised as a stand-in)."""
    import sys

    from harness.standins.models import _patched

    tc = config.auxcap_tiny
    mod = sys.modules[cls.__module__]
    patches = [
        (mod, "Qwen2MoeSparseMoeBlock", _moe_standin(mod.Qwen2MoeSparseMoeBlock, tc)),
        (mod, "Qwen2MoeMLP", standin_class(mod.Qwen2MoeMLP, tc, {
            "gate_up_proj": _no_quant(), "down_proj": _no_quant()})),
        (mod, "get_rope", _no_rope),
    ]
    gdn = "Qwen3GatedDeltaNet" if hasattr(mod, "Qwen3GatedDeltaNet") else "Qwen3_5GatedDeltaNet"
    patches.append((mod, gdn, standin_class(getattr(mod, gdn), tc, {"in_proj_qkvz": None})))
    with _patched(patches):
        model = cls(config, quant_config=None)
    attn_cls = standin_class(_inline_attention_signature(), tc, {})
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
        """Clear every layer's ``_is_layer_to_capture`` (the setters never clear stale
        flags), then call the model's own setter with the already-mapped ids (the
        ForCausalLM / VL wrapper maps ``id + 1``). Its ``setattr(self.layers[layer_id],
        ...)`` raises IndexError for ``end_layer``."""
        for layer in model.layers:
            layer.__dict__.pop("_is_layer_to_capture", None)
        model.layers_to_capture = []
        if indices:
            getattr(model, setter)(list(indices))

    return configure


# ---------------------------------------------------------------- specs

_NEXT_NOTE = (
    "Layers 3 and 7 are full attention (full_attention_interval=4), the rest Gated "
    "DeltaNet; every layer sparse. capture_gathered at attn_boundary.prepare "
    "(qwen3_next.py 584-605, 877-906) for flagged layers; the model's setters "
    "(954-962) raise IndexError for end_layer. The last layer completes its sum at "
    "exit (terminal stage): the pin's bug F is gone."
)

_QWEN3_5_NOTE = (
    "Layers 3 and 7 are full attention, the rest Gated DeltaNet. capture_gathered at "
    "attn_boundary.prepare for flagged layers (qwen3_5.py 1200-1233, 1647-1681); "
    "set_dflash/set_eagle3_layers_to_capture (1889-1897) raise IndexError for "
    "end_layer. Deepstack (input_deepstack_embeds, layers 0-2) is not exercised."
)


def _spec(**kw):
    return ModelSpec(standins={}, construct=_construct, defers=True,
                     layer_output=layer_output, run=run_plain, **kw)


SPECS = [
    _spec(
        name="qwen3_next",
        module=_QWEN3_NEXT,
        model_cls="Qwen3NextModel",
        config=_next_config,
        configure=_configure("set_eagle3_layers_to_capture"),
        pin_bugs=frozenset({"B", "C", "L"}),
        fixed_by={"B": "qwen3-next-aux-packer"},
        wraps=("qwen3_next.py: Qwen3NextForCausalLM",),
        note=_NEXT_NOTE,
    ),
    _spec(
        name="qwen3_5",
        module=_QWEN3_5,
        model_cls="Qwen3_5ForCausalLM",
        config=_qwen3_5_config,
        configure=_configure("set_dflash_layers_to_capture"),
        pin_bugs=frozenset({"B", "C", "L"}),
        fixed_by={"B": "qwen3-next-aux-packer"},
        wraps=("qwen3_5.py: Qwen3_5ForConditionalGeneration (via qwen3_vl.py's wrapper)",),
        note=_QWEN3_5_NOTE,
    ),
    _spec(
        name="qwen3_5_moe",
        module=_QWEN3_5,
        model_cls="Qwen3_5MoeForCausalLM",
        config=lambda tc: _qwen3_5_config(tc, moe=True),
        configure=_configure("set_dflash_layers_to_capture"),
        pin_bugs=frozenset({"B", "C", "L"}),
        fixed_by={"B": "qwen3-next-aux-packer"},
        wraps=("qwen3_5.py: Qwen3_5MoeForConditionalGeneration (Qwen3_5MoeForCausalLM, "
               "via qwen3_vl.py's wrapper)",),
        note=_QWEN3_5_NOTE,
    ),
]
