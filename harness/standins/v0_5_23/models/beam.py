"""Beam on 0.5.23: ``BeamModel`` (beam.py; ``BeamForCausalLM`` holds it).

Beam does not use the layer boundaries: a decoder layer (``BeamDecoderLayer``) threads
its own stream with sandwich norms and depth-scaled residuals and returns the layer's
complete output. ``BeamModel.forward`` has two loops over the same layers:

* the fused loop (``_forward_fused``, the default: ``fuse_layers`` is set unless CPU
  offload is on or the PP stage has no layer), which calls ``layer.forward_fused``;
  each norm/residual transition is one ``BeamSandwichResidualRMSNormOp`` that also
  produces the next layer's input norm (or the final norm), so the layer returns
  ``(next normed input, residual stream)``. Its optional all-reduce replacements
  (Beam's custom-all-reduce push plane, FlashInfer's MNNVL all-reduce) need CUDA
  tensors: on the CPU ``_all_reduce_limits`` and ``_flashinfer_ar_for`` return None and
  every module reduces itself.
* the plain loop (``layer(...)``), which runs when ``fuse_layers`` is off (CPU offload).

Every attention and MLP/MoE all-reduces itself (``RowParallelLinear`` o_proj /
down_proj with the default ``reduce_results=True``, ``BeamMoE``'s post-experts
all-reduce) unless the fused loop passes ``skip_all_reduce=True`` for a replacement to
own the sum: the stand-ins are REDUCE_SELF and honour ``skip_all_reduce``.

Stand-ins: ``BeamAttention`` (RadixAttention, the fused QK-norm + RoPE and gate
kernels, SSMax), ``BeamMLP`` and ``BeamMoE`` (router GEMV, grouped top-k, FusedMoE).
The decoder layers, their four RMSNorms and the fused sandwich-norm op (its native
forward on the CPU), the rotary cache, the embeddings, the model's two loops, their
capture sites and the final norm are the real ones. The tiny config keeps the
checkpoint's schedules: sliding-window layers with a full-attention layer every sixth
and the last; three dense MLP layers, then MoE.

Captures: DFlash only (``set_dflash_layers_to_capture``; ids are layer outputs, PP=1
only): after layer ``i`` for ``i in layers_to_capture``, the layer's output (plain
loop) or the residual stream the fused transition returns (fused loop), the last
layer's inside the loop, before the final norm; ``post_norm`` was refused at start-up
(final-layer-capture: "P"), and with beam-post-norm-capture both loops take the last
capture after the final norm instead (the matrix's post-norm cases, guarded by it). A
plain list (B). The spec sets ``layers_to_capture`` (capture index ``i`` = id
``i - 1``). Two specs: ``beam`` (the fused loop) and ``beam_unfused`` (the plain
loop). No layer boundaries, so both trace fullgraph (``TRACES_FULLGRAPH``).
"""

from __future__ import annotations

import contextlib

from harness.standins.blocks import REDUCE_SELF
from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import running, standin_class


def _beam_config(tc):
    from sglang.srt.configs.beam import BeamConfig

    return hf_config(
        tc,
        BeamConfig,
        architectures=["BeamForCausalLM"],
        # BeamConfig's defaults: sliding-window attention with full attention every
        # sixth layer and on the last; three dense MLP layers, then MoE.
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        sliding_window=4,
        num_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=tc.intermediate_size,
        routed_scaling_factor=1.0,
        final_logit_softcapping=None,
    )


def _standin(orig_cls, tc):
    """REDUCE_SELF, except that ``skip_all_reduce=True`` (the fused loop's request when
    a replacement owns the sum) returns this rank's partial sum, as the original does."""
    import inspect

    from harness.standins.blocks import _bind

    base = standin_class(orig_cls, tc, {}, REDUCE_SELF)
    fwd_sig = inspect.signature(orig_cls.forward)

    class StandIn(base):
        def forward(self, *args, **kwargs):
            bound = _bind(fwd_sig, args, kwargs)
            if not bound.get("skip_all_reduce"):
                return super().forward(*args, **kwargs)
            x = bound["hidden_states"] if "hidden_states" in bound else bound["x"]
            return x.clone() if x.shape[0] == 0 else self._partial(x)

    StandIn.__name__ = StandIn.__qualname__ = base.__name__
    return StandIn


class _StandInRotary:
    """For ``BeamRotaryEmbedding``: the model builds one rotary cache for its sliding
    layers and hands it to their attention (a stand-in, which applies no RoPE);
    SGLang's RotaryEmbedding needs a CUDA / vllm kernel to construct on the CPU."""

    def __init__(self, config):
        self.head_dim = config.head_dim


def _build_patches(mod):
    from harness.standins.blocks import TinyConfig

    tc = TinyConfig()
    return [
        (mod, "BeamRotaryEmbedding", _StandInRotary),
        # RadixAttention, fused QK-norm/RoPE, SSMax and the attention gate; o_proj
        # RowParallelLinear with the default reduce_results=True (forward passes
        # skip_all_reduce through).
        (mod, "BeamAttention", _standin(mod.BeamAttention, tc)),
        # gate_up / down_proj; down_proj reduces unless skip_all_reduce.
        (mod, "BeamMLP", _standin(mod.BeamMLP, tc)),
        # Router, grouped TopK, FusedMoE; the post-experts all-reduce unless
        # skip_all_reduce (defer_sum: the CUDA push plane only).
        (mod, "BeamMoE", _standin(mod.BeamMoE, tc)),
    ]


def _layer_output(out):
    """A Beam layer's complete output: what ``forward`` returns, or the residual stream
    of ``forward_fused``'s ``(next normed input, residual)``."""
    return out[1] if isinstance(out, tuple) else out


@contextlib.contextmanager
def _fused_hooks_fire(layers):
    """The fused loop calls ``layer.forward_fused(...)``, not ``layer(...)``, so a
    layer's forward hooks (the suites' reference taps) would not run. While a layer has
    hooks, its ``forward_fused`` runs them on what it returns, as ``nn.Module.__call__``
    does for ``forward``. Layers without hooks are left alone."""
    hooked = [layer for layer in layers if layer._forward_hooks]

    def with_hooks(layer):
        fused = type(layer).forward_fused.__get__(layer)

        def forward_fused(*args, **kwargs):
            out = fused(*args, **kwargs)
            for hook in list(layer._forward_hooks.values()):
                result = hook(layer, args, out)
                out = out if result is None else result
            return out

        return forward_fused

    for layer in hooked:
        layer.forward_fused = with_hooks(layer)
    try:
        yield
    finally:
        for layer in hooked:
            layer.__dict__.pop("forward_fused", None)


def _run(model, input_ids, positions, forward_batch, **inputs):
    """The model's forward with the batch held and, in the fused loop, the layers'
    reference hooks firing (``model`` may be the fullgraph suite's wrapper)."""
    with running(forward_batch), _fused_hooks_fire(list(model.layers)):
        return model(input_ids, positions, forward_batch, **inputs)


def _configure(model, indices):
    """What ``BeamForCausalLM.set_dflash_layers_to_capture`` leaves on the model for
    capture indices ``indices``: the layer-output ids ``i - 1`` (a tuple)."""
    if any(i < 1 for i in indices):
        raise ValueError(f"beam captures layer outputs: no capture index {list(indices)}")
    model.layers_to_capture = tuple(i - 1 for i in indices)


def _construct(fused):
    def construct(cls, config):
        model = cls(config, quant_config=None)
        if not fused:
            # As with CPU offload (beam.py: fuse_layers is off when cpu_offload_gb or
            # offload_group_size is set): the plain loop.
            model.fuse_layers = False
        return model

    return construct


def _spec(name, fused, note):
    return ModelSpec(
        name=name,
        module="sglang.srt.models.beam",
        model_cls="BeamModel",
        standins={},
        build_patches=_build_patches,
        config=_beam_config,
        construct=_construct(fused),
        configure=_configure,
        layer_output=_layer_output,
        run=_run,
        # B: list + cat. DFlash only (no EAGLE3 setter; the model runner refuses
        # EAGLE3 with one error): not a bug letter.
        # P: post_norm refused at start-up (final-layer-capture's declaration), served
        # by beam-post-norm-capture.
        pin_bugs=frozenset({"B", "P"}),
        fixed_by={"B": "beam-aux-packer", "P": "beam-post-norm-capture"},
        wraps=("beam.py: BeamForCausalLM (set_dflash_layers_to_capture only, PP=1)",),
        note=note,
    )


SPECS = [
    _spec("beam", True,
          "The fused loop (BeamModel._forward_fused, the default): after layer i for i in "
          "layers_to_capture, the residual stream forward_fused returns (pristine beam.py "
          "1226-1227), the last layer's in the loop: K of K; a plain list. The final "
          "norm is the last fused transition's."),
    _spec("beam_unfused", False,
          "The plain loop (fuse_layers off, as under CPU offload): after layer i for i "
          "in layers_to_capture, the layer's output (pristine beam.py 1164-1169), the "
          "last layer's in the loop: K of K; a plain list."),
]
