"""The capturing models of SGLang 0.5.23, each a tiny real SGLang model with CPU stand-ins.

One module per model family, as the pin's :mod:`harness.standins.models` (same spec
names where the model exists); each exposes ``SPECS``, a list of
:class:`harness.standins.models.ModelSpec`, found by
:func:`harness.standins.models.specs` when ``$HARNESS_BASE`` is 0.5.23 and built by
:func:`harness.standins.models.build`.

What differs from the pin, and the helpers here for it:

* The stage boundaries (``layers/layer_boundary``) own every sum. Stand-ins return this
  rank's partial sum and never all-reduce (``REDUCE_NONE``); their originals are built
  with ``reduce_results=False`` (and SGLang's ``check_stage_producers`` rejects any
  producer with ``reduce_results=True``). They carry the attributes the decoder layers
  read at construction (``qkv_proj`` / ``gate_up_proj`` for ``fuse_input_quant``, ...).
* A decoder layer returns only ``hidden_states`` (possibly an opaque ``OwedOutput``
  handle while its sum is owed); the residual lives in ``forward_batch.residual_stream``.
  The complete output of a layer (what capture index ``i + 1`` must equal) is
  :func:`layer_output`: ``residual_batch.snapshot(out, forward_batch)``, fresh storage
  holding the completed sum plus the residual, with any owed sum reduced *on a clone*
  so the real consumer still does its own. The forward batch comes from a closure:
  every spec's ``run`` goes through :func:`running` (:func:`run_plain` /
  :func:`run_scattered`), which holds the batch being run, so the generic suite's
  plain forward hook ``spec.layer_output(out)`` needs no extra argument.

  Why it is independent of the capture code under test: captures go through
  ``attn_boundary.prepare(capture=...)`` (``stream.complete`` + the norm read, then
  ``stream.residual`` or its gathered move, with the ``owned`` decision and the
  collector's clone), ``capture_gathered=``, or ``residual_batch.final_norm(capture=)``.
  The snapshot runs none of these: it is taken in a hook right after the layer
  returns, on a run with fusion off and nothing captured, and it does not consume or
  change the stream (``ResidualStream.snapshot``, ``stream.py``). Capture cases at
  TP > 1 are compared with the TP = 1 reference, where nothing is owed and the
  snapshot is just ``value + residual``. (longcat_flash captures with this same
  snapshot; see its note. gemma3 does not use the boundaries and keeps the pin's
  ``hidden_states + residual``.)
* ``pin_bugs`` on this base lists the bugs of *pristine 0.5.23* (the base the 0.5.23
  series applies to), with the pin's letters: "B" list + cat, "C" the last layer never
  captured (K-1 of K, a "captured K-1 of K" RuntimeError, or an IndexError in a flag
  setter), "E" captures aliased by a later in-place norm, "X" the capture expression
  is not the layer's output, "T" two-batch overlap drops captures. "A" (capture
  before a deferred all-reduce) and "F" (the last layer deferring into the final norm)
  are gone on this base: the boundaries complete an owed sum before a capture and at
  the terminal stage.
* ``torch.compile(model.forward, fullgraph=True)`` cannot trace a model that uses the
  layer boundaries with torch 2.14.1: Dynamo refuses to construct a ``msgspec.Struct``
  (``ResidualStream.record`` -> ``Contribution(...)``, residual/stream.py 168:
  "Unsupported object.__new__ user-defined class construction"). gemma3 (no
  boundaries) traces.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

# The 0.5.23 series (patches/0.5.23): the Patch-Id that fixes each bug of pristine
# 0.5.23 in every model whose spec names no other (deepseek_v2 has its own "C"). "B"
# (list + cat) is left to upstream, which is migrating models to its packer.
FIXED_BY = {
    "C": "models-capture-final-layer",
    "E": "gemma3-capture-layer-output",
    "X": "gemma3-capture-layer-output",
    "T": "models-capture-skips-tbo",
    "L": "models-capture-by-index",
    "R": "models-capture-setters",
    "U": "models-capture-setters",
}

# torch 2.14's Dynamo cannot trace the layer boundaries' msgspec Structs (constructing
# ``Contribution`` / ``ExitDecision``, setting a ``Contribution`` field), so no model
# that uses them traces fullgraph on pristine 0.5.23 either. The fullgraph test compiles
# those models with graph breaks allowed and accepts only breaks naming these.
GRAPH_BREAKS = (
    "UserDefinedObjectVariable(Contribution) __setattr__",
    "class=<class 'sglang.srt.layers.layer_boundary.",
)
# The models that do trace fullgraph on 0.5.23 (they do not use the boundaries).
TRACES_FULLGRAPH = frozenset({"gemma3", "lfm2", "lfm2_moe", "muse_glimmer", "beam", "beam_unfused"})

__all__ = ["FIXED_BY", "GRAPH_BREAKS", "TRACES_FULLGRAPH", "layer_output", "running", "run_plain",
           "run_scattered", "current_batch", "standin_class", "standins", "mla_standin"]

_CURRENT: list = []


def current_batch():
    """The forward batch of the innermost run in progress (see :func:`running`)."""
    if not _CURRENT:
        raise RuntimeError("layer_output outside a spec run: no current forward batch")
    return _CURRENT[-1]


@contextlib.contextmanager
def running(forward_batch) -> Iterator[None]:
    """Hold ``forward_batch`` as the current batch for the duration of a model run."""
    _CURRENT.append(forward_batch)
    try:
        yield
    finally:
        _CURRENT.pop()


def layer_output(out, forward_batch: Optional[Any] = None):
    """A decoder layer's complete output: the stream's snapshot of what the layer
    returned (``hidden_states`` or an owed handle; the first item of a tuple such as
    DeepSeek's ``(hidden_states, topk_indices)``), completed sum plus residual."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    h = out[0] if isinstance(out, tuple) else out
    fb = forward_batch if forward_batch is not None else current_batch()
    return residual_batch.snapshot(h, fb)


def run_plain(model, input_ids, positions, forward_batch, **inputs):
    """``model(input_ids, positions, forward_batch, **inputs)`` with the batch held for
    :func:`layer_output` (``inputs``: extra forward arguments, e.g.
    ``input_deepstack_embeds``)."""
    with running(forward_batch):
        return model(input_ids, positions, forward_batch, **inputs)


def run_scattered(model, input_ids, positions, forward_batch):
    """As ``DeepseekV2ForCausalLM.forward``: attention-TP input scattering decided per
    batch (``get_attn_tp_context().maybe_input_scattered``)."""
    from sglang.srt.layers.layer_boundary import get_attn_tp_context

    with running(forward_batch), get_attn_tp_context().maybe_input_scattered(forward_batch):
        return model(input_ids, positions, forward_batch)


def standin_class(orig_cls: type, cfg, attrs: Optional[dict] = None, reduce: str = "none") -> type:
    """:func:`harness.standins.blocks.standin_class` for 0.5.23.

    The shared stand-in reads its TP rank and size from
    ``sglang.srt.distributed.get_tensor_model_parallel_rank`` / ``_world_size``, which
    0.5.23 no longer has (``runtime_context.get_parallel().tp_rank`` / ``tp_size``);
    only the constructor differs. ``reduce`` is ``REDUCE_NONE`` (the default: the
    boundaries own every sum) except in a model that does not use the layer
    boundaries (gemma3: ``REDUCE_SELF``, its o_proj / down_proj all-reduce).
    """
    import inspect
    import zlib

    import torch

    from harness.standins.blocks import _bind
    from harness.standins.blocks import standin_class as shared

    base = shared(orig_cls, cfg, reduce, attrs)
    init_sig = inspect.signature(orig_cls.__init__)

    def __init__(self, *args, **kwargs):
        from sglang.srt.runtime_context import get_parallel

        from harness.standins.kernels import model_dtype

        torch.nn.Module.__init__(self)
        bound = _bind(init_sig, args, kwargs)
        key = bound.get("prefix") or f"{orig_cls.__name__}.{bound.get('layer_id')}"
        self.auxcap_key = key
        parallel = get_parallel()
        self.tp_size = parallel.tp_size
        self._init_shards(cfg.seed, zlib.crc32(key.encode()), cfg.hidden_size,
                          cfg.intermediate_size, parallel.tp_rank, self.tp_size,
                          model_dtype(cfg))
        for name, value in (attrs or {}).items():
            setattr(self, name, value)

    cls = type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})
    cls.__qualname__ = base.__qualname__
    return cls


def standins(table: dict, module_name: Optional[str] = None, tc=None, reduce: str = "none"):
    """``build_patches`` installing 0.5.23 stand-ins: ``table`` maps a module-level
    class name to the extra attributes its decoder layer reads from it; the names are
    looked up in the spec's module, or in ``module_name`` (where the decoder layer
    class looks them up) when given. ``tc``: the spec's ``TinyConfig``; ``reduce``:
    see :func:`standin_class`."""

    def build_patches(mod):
        import importlib

        from harness.standins.blocks import TinyConfig

        target = importlib.import_module(module_name) if module_name else mod
        return [
            (target, name, standin_class(getattr(target, name), tc or TinyConfig(),
                                         dict(attrs or {}), reduce))
            for name, attrs in table.items()
        ]

    return build_patches


def mla_standin(orig_cls, tc):
    """A stand-in for DeepseekV2AttentionMLA (deepseek_v2.py, glm4_moe_lite.py): this
    rank's partial sum (o_proj reduce_results=False, deepseek_v2.py 2636). What the
    decoder layer reads from it: ``prepare_qkv_latent`` (the boundaries'
    qkv_latent_func, 2690), ``maybe_use_decode_attn_tp(fb)`` (a context manager,
    2815), and on an input-scattered batch the attention runs over every token of the
    TP group (``get_attn_tp_context().fetch_qkv_latent()`` gathers after the
    q-lora projection; here the latent is the normed input itself)."""
    import contextlib

    base = standin_class(orig_cls, tc, {})

    class StandInMLA(base):
        def prepare_qkv_latent(self, hidden_states, forward_batch):
            return hidden_states

        @contextlib.contextmanager
        def maybe_use_decode_attn_tp(self, forward_batch):
            yield

        def forward(self, positions, hidden_states, forward_batch, zero_allocator=None,
                    input_on_attn_tp_slices=False, llama_4_scaling=None,
                    prev_topk_indices=None, **_):
            from sglang.srt.layers.layer_boundary import get_attn_tp_context

            if get_attn_tp_context().input_scattered:
                hidden_states = get_attn_tp_context().fetch_qkv_latent()
            if hidden_states.shape[0] == 0:
                return hidden_states.clone()
            return self._partial(hidden_states)

    StandInMLA.__name__ = StandInMLA.__qualname__ = base.__name__
    return StandInMLA
