"""Nemotron-H on 0.5.23: ``NemotronHModel`` (nemotron_h.py; nano_nemotron_vl.py wraps it).

A hybrid stack of one-mixer layers, one per character of
``config.hybrid_override_pattern``: Mamba2 (``M``) and attention (``*``) mixer stages,
dense MLP (``-``) and MoE (``E``) FFN stages, each its own decoder layer on the layer
boundaries (``nemotron_h_utils.make_stage_boundary``). Every producer is built with
``reduce_results=False`` (the boundaries own every sum), so every stand-in is
REDUCE_NONE; the real decoder layers, boundaries and final norm run. A mixer stage
before an FFN stage leaves its sum to that stage's input; an FFN's sum is owed to the
next stage's input (or the final norm) at TP > 1. The Mamba mixer runs through the
linear-attention backend, stood in as for granitemoehybrid (the pin's misc.py
``_granite_backend``: a real ``HybridLinearAttnBackend`` / ``Mamba2AttnBackend`` pair
whose ``forward`` calls the stood-in mixer).

Captures: ``boundary.capture_output`` of layer ``i`` (the stream entering it) for ``i``
in ``layers_to_capture``, and the last layer's output as a ``residual_batch.snapshot``
after the loop (or the final norm's output under ``post_norm``): K of K.
"""

from __future__ import annotations

import contextlib
import sys

from harness.standins.models import ModelSpec, hf_config
# granitemoehybrid's CPU linear-attention backend: the stood-in MambaMixer2 runs
# through it as Mamba2AttnBackend.forward runs the real one.
from harness.standins.models.misc import _granite_backend
from harness.standins.v0_5_23.models import layer_output, running, standins

# Every layer kind, and every transition between a mixer and an FFN stage: M -> M,
# M -> MLP, MLP -> attention, attention -> MoE, MoE -> M, MLP -> MoE, MoE -> final norm.
_PATTERN = "MM-*EM-E"


def _nemotron_h_config(tc):
    from sglang.srt.configs.nemotron_h import NemotronHConfig

    n = tc.num_layers
    return hf_config(
        tc,
        NemotronHConfig,
        hybrid_override_pattern=(_PATTERN * (n // len(_PATTERN) + 1))[:n],
        layer_norm_epsilon=1e-6,
        mlp_hidden_act="relu2",
        ssm_state_size=16,
        mamba_num_heads=4,
        mamba_head_dim=tc.hidden_size * 2 // 4,
        mamba_n_groups=1,
        # mamba2_cache_params reads n_groups, which the constructor does not set
        # from mamba_n_groups: the checkpoints' config.json carries it as its own key.
        n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=tc.intermediate_size,
        moe_shared_expert_intermediate_size=tc.intermediate_size,
    )


@contextlib.contextmanager
def _hooks_fire(layers):
    """NemotronHModel.forward calls ``layer.forward(...)``, not ``layer(...)``, so a
    layer's forward hooks (the suites' reference taps) would not run. While a layer
    has hooks, its ``forward`` goes through ``nn.Module.__call__`` (which runs the
    class's forward and the hooks). Layers without hooks are left alone (the
    fullgraph suite traces the plain forward)."""
    hooked = [layer for layer in layers
              if layer._forward_hooks or layer._forward_pre_hooks]

    def through_call(layer):
        def forward(*args, **kwargs):
            del layer.forward  # __call__ dispatches to the class's forward
            try:
                return layer(*args, **kwargs)
            finally:
                layer.forward = forward

        return forward

    for layer in hooked:
        layer.forward = through_call(layer)
    try:
        yield
    finally:
        for layer in hooked:
            layer.__dict__.pop("forward", None)


def _run(model, input_ids, positions, forward_batch, **inputs):
    """The model's forward with the CPU Mamba backend where its Mamba layers look it
    up (the module of their class: nemotron_h, or the memory suite's pristine copy of
    it; ``model`` may be the fullgraph suite's wrapper), its layers' hooks firing,
    and the batch held for :func:`layer_output`."""
    layers = list(model.layers)
    mod = next(sys.modules[type(layer).__module__] for layer in layers
               if hasattr(layer, "_forward_mamba"))
    saved = mod.get_attn_backend
    backend = _granite_backend()
    mod.get_attn_backend = lambda: backend
    try:
        with running(forward_batch), _hooks_fire(layers):
            return model(input_ids, positions, forward_batch, **inputs)
    finally:
        mod.get_attn_backend = saved


def _construct(cls, config):
    # NemotronHModel takes keyword arguments only.
    return cls(config=config, quant_config=None)


SPECS = [
    ModelSpec(
        name="nemotron_h",
        module="sglang.srt.models.nemotron_h",
        model_cls="NemotronHModel",
        standins={},
        build_patches=standins({
            # reduce_results=False (pristine nemotron_h.py 643); run through the
            # linear-attention backend (see _run).
            "MambaMixer2": {},
            # o_proj reduce_results=False (732).
            "NemotronHAttention": {},
            # The dense FFN, reduce_results=False (557).
            "NemotronHMLP": {},
            # Routed and shared experts reduce_results=False (282, 313): the sum is
            # the FFN boundary's.
            "NemotronHMoE": {},
        }),
        config=_nemotron_h_config,
        construct=_construct,
        run=_run,
        layer_output=layer_output,
        # An FFN's sum is owed past its boundary's finish and completed at the next
        # stage's input (or the final norm) at TP > 1.
        defers=True,
        # B: list + cat. DFlash only (no EAGLE3 setter; the model runner refuses
        # EAGLE3 with one error): not a bug letter.
        pin_bugs=frozenset({"B"}),
        fixed_by={"B": "nemotron-h-aux-packer"},
        wraps=("nemotron_h.py: NemotronHForCausalLM, NemotronHPuzzleForCausalLM "
               "(set_dflash_layers_to_capture only)",
               "nano_nemotron_vl.py: NemotronH_Nano_VL_V2 and its subclasses"),
        note="boundary.capture_output of layer i for i in layers_to_capture (pristine "
        "nemotron_h.py 876-882), and the last layer's output as a "
        "residual_batch.snapshot after the loop (895-897): K of K. One mixer or FFN "
        "per layer, per hybrid_override_pattern. set_dflash_layers_to_capture maps HF "
        "layer id k to capture index k + 1 (a set); the spec sets "
        "NemotronHModel.layers_to_capture (capture indices) directly.",
    ),
]
