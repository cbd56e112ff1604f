"""Attention-TP input scattering (``--enable-attn-tp-input-scattered``) on SGLang 0.5.23.

The pin's switch (:func:`harness.standins.batch.attn_tp_input_scattered`) only set
``AttnTpContext.allow_input_scattered``. On 0.5.23 that is not enough:

* the stage boundaries (``layers/layer_boundary``) bind the ``INPUT_SCATTERED`` batch
  variant *at construction*, exactly when ``layout.input_scattered_configured()``
  holds (``get_parallel().enable_attn_tp_input_scattered``, TP > 1, no attention DP,
  no a2a MoE, ...): the model has to be built inside :func:`attn_tp_input_scattered`;
* ``AttnTpContext.init_context(q_lora_rank, is_dsa)`` (adapters/attention.py) narrows
  that per model: CUDA/NPU only, a q-lora model, not DSA (unless MHC), no piecewise
  CUDA graph, and not EAGLE3 (``get_spec().speculative_algorithm != "EAGLE3"``). It is
  called here, the real one, with only its platform gate (``_is_cuda``) answered yes;
  ``speculative_algorithm`` is overridden (``DFLASH`` by default: EAGLE3 is excluded
  by upstream, so DFlash is the realistic capturing case);
* the model runner pads an input-scattered extend batch to a multiple of TP before the
  forward (``ForwardBatch.prepare_attn_tp_scatter_input``, model_runner.py 1732);
  :func:`prepare_scattered_batch` runs that real method with a stub runner.

The collectives run as SGLang's own: the TP reduce-scatter at a stage entry and the
attention-TP all-gather of ``input_move`` / ``tp_gather`` go through the
``reg_reduce_scatter_tensor`` / ``reg_all_gather_into_tensor`` custom ops, whose CPU
kernels :mod:`.dist` registers (gloo, same output buffers: SGLang's aliasing). No
kernel is replaced here; fusion stays whatever :func:`fusion_mode` says.

:func:`scattered_capture_case` / :func:`scattered_capture_matrix` run the
``deepseek_v2`` spec (with ``q_lora_rank`` set) in a rank with scattering on and
return plain data for a comparison with the TP = 1 reference (where nothing scatters:
``input_scattered_configured()`` needs TP > 1). Stdlib-only at import time.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Dict, Iterator, List, Optional, Sequence

__all__ = [
    "attn_tp_input_scattered",
    "prepare_scattered_batch",
    "scattered_capture_case",
    "scattered_capture_matrix",
    "scatter_allowed",
    "Q_LORA_RANK",
]

Q_LORA_RANK = 8


@contextlib.contextmanager
def attn_tp_input_scattered(
    enabled: bool = True,
    *,
    q_lora_rank: Optional[int] = Q_LORA_RANK,
    is_dsa: bool = False,
    speculative_algorithm: Optional[str] = "DFLASH",
) -> Iterator[Any]:
    """Input-scattered attention in effect for the duration (model construction and
    forward). Yields SGLang's ``AttnTpContext``; its ``allow_input_scattered`` is what
    the real ``init_context`` decided (False at TP = 1, for EAGLE3, without q-lora).

    ``enabled=False``: the flag off (``allow_input_scattered`` False), everything else
    as with it on.
    """
    import unittest.mock as mock

    from sglang.srt.layers.layer_boundary import get_attn_tp_context
    from sglang.srt.layers.layer_boundary.adapters import attention as attn_adapter
    from sglang.srt.runtime_context import get_parallel, get_spec

    ctx = get_attn_tp_context()
    saved = (ctx.allow_input_scattered, ctx.is_dsa)
    spec_override = (
        get_spec().override(speculative_algorithm=speculative_algorithm)
        if speculative_algorithm is not None
        else contextlib.nullcontext()
    )
    try:
        with get_parallel().override(enable_attn_tp_input_scattered=enabled), spec_override:
            # The platform gate only: q-lora, DSA, piecewise CUDA graph and EAGLE3 stay
            # SGLang's own conditions.
            with mock.patch.object(attn_adapter, "_is_cuda", True):
                ctx.init_context(q_lora_rank, is_dsa)
            yield ctx
    finally:
        ctx.allow_input_scattered, ctx.is_dsa = saved


class _StubAttnBackend:
    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return 1

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1


class _StubModelRunner:
    """What ``ForwardBatch.prepare_attn_tp_scatter_input`` reads from the runner."""

    attn_backend = _StubAttnBackend()

    def attn_tp_sequence_sharded(self, num_tokens: int) -> bool:
        return False


def prepare_scattered_batch(forward_batch) -> None:
    """The model runner's eager-forward step for a batch without MLP sync
    (``model_runner._prepare_eager_forward_batch`` -> ``prepare_attn_tp_scatter_input``):
    an input-scattered extend batch is padded to a multiple of TP (zeros)."""
    forward_batch.prepare_attn_tp_scatter_input(_StubModelRunner())


# ------------------------------------------------------------------ the case

_MODELS: Dict[tuple, Any] = {}


def _spec():
    import dataclasses

    from harness.standins.models import specs

    base = specs()["deepseek_v2"]

    def config(tc):
        cfg = base.config(tc)
        cfg.q_lora_rank = Q_LORA_RANK  # as V3/R1; the attention itself stands in
        return cfg

    return dataclasses.replace(base, config=config)


def get_scattered_model(scattered: bool = True):
    """``DeepseekV2Model`` (q-lora config, MLA stand-in) built inside
    :func:`attn_tp_input_scattered`: its stages bind the input-scattered variant
    when TP > 1. One per process and ``scattered``."""
    from harness.standins.models import build

    key = ("deepseek_v2", scattered)
    if key not in _MODELS:
        with attn_tp_input_scattered(scattered):
            _MODELS[key] = build(_spec())
    return _MODELS[key]


def _input_ids(num_tokens: int, vocab_size: int, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (num_tokens,), generator=g)


@contextlib.contextmanager
def _observe(model, record: dict, simulate_final_capture: bool):
    """Record the packer the forward builds and what reaches ``final_norm`` (rows of
    the output and of the residual). ``simulate_final_capture``: where the model's
    forward passes no ``capture`` to ``final_norm`` although ``end_layer`` is in
    ``layers_to_capture``, pass ``capture=aux.capture`` as the final-layer fix does
    (``DeepseekV2Model.forward``); a forward that already does is left alone."""
    import unittest.mock as mock

    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.layers.layer_boundary.residual.batch import stream_of
    from sglang.srt.models import deepseek_v2

    packers: List[Any] = []
    base = deepseek_v2.AuxHiddenStatePacker

    class Packer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            packers.append(self)

    orig_final_norm = residual_batch.final_norm

    def final_norm(hidden_states, forward_batch, layernorm, capture=None, **kw):
        stream = stream_of(forward_batch)
        h = hidden_states if hasattr(hidden_states, "shape") else None
        record["final_norm_output_rows"] = None if h is None else int(h.shape[0])
        res = stream.residual
        record["final_norm_residual_rows"] = None if res is None else int(res.shape[0])
        record["final_capture_by_model"] = capture is not None
        wanted = model.end_layer in model.layers_to_capture
        if capture is None and simulate_final_capture and wanted and packers:
            capture = packers[-1].capture
            record["final_capture_simulated"] = True
        if capture is not None:
            inner = capture

            def capture(value, *a, **k):
                record["final_capture_rows"] = int(value.shape[0])
                return inner(value, *a, **k)

        return orig_final_norm(hidden_states, forward_batch, layernorm, capture, **kw)

    with mock.patch.object(deepseek_v2, "AuxHiddenStatePacker", Packer), \
            mock.patch.object(residual_batch, "final_norm", final_norm):
        yield


def scattered_capture_case(
    rank: int,
    world_size: int,
    *,
    num_tokens: int,
    layers_to_capture: Sequence[int],
    scattered: bool = True,
    simulate_final_capture: bool = False,
    fusion: str = "off",
    pad_to: Optional[int] = None,
    reference: bool = False,
) -> Dict[str, Any]:
    """One deepseek_v2 forward with ``layers_to_capture``, scattering on (at TP > 1),
    the batch padded as the model runner pads it; returns plain data: the packed
    captures, the final hidden states, and what was observed: whether the layers ran
    input-scattered, the rows of the output / residual reaching ``final_norm`` and of
    a final-layer capture. ``reference``: instead, the reference (run it at TP = 1,
    where nothing scatters): ``expected``, the complete outputs of the requested
    layers by forward hooks on a run that captures nothing, and ``reference_final``.
    ``pad_to``: append zero token ids up to that many (the runner's padding, for a
    TP = 1 reference of a padded batch)."""
    import torch

    from harness.standins.batch import make_forward_batch
    from harness.standins.kernels import device, fusion_mode
    from harness.standins.v0_5_23.models import layer_output
    from sglang.srt.runtime_context import get_forward

    spec = _spec()
    model = get_scattered_model(scattered)
    ids = _input_ids(num_tokens, spec.tiny.vocab_size)
    if pad_to is not None and pad_to > num_tokens:
        ids = torch.cat([ids, ids.new_zeros(pad_to - num_tokens)])
    ids = ids.to(device())
    hidden = spec.tiny.hidden_size
    want = sorted(set(layers_to_capture))

    # What init_dp_gathered_buffer does when the worker loads the model: the DP
    # gather buffers take the model's hidden size and dtype. Set here, per case:
    # another case in the same rank process may have set its own.
    from sglang.srt.layers.dp_attention import _DpGatheredBufferWrapper

    _DpGatheredBufferWrapper.set_metadata(
        hidden, model.embed_tokens.weight.dtype, torch.device(device()))

    def forward(capture, hooks=None):
        record: Dict[str, Any] = {}
        spec.configure(model, list(capture))
        handles = [layer.register_forward_hook(hooks) for layer in model.layers] if hooks else []
        try:
            with attn_tp_input_scattered(scattered) as ctx, fusion_mode(fusion), \
                    _observe(model, record, simulate_final_capture):
                fb = make_forward_batch(ids, "extend")
                prepare_scattered_batch(fb)
                with torch.no_grad():
                    out = spec.run(model, fb.input_ids, fb.positions, fb)
                record["allow_input_scattered"] = ctx.allow_input_scattered
        finally:
            for h in handles:
                h.remove()
            spec.configure(model, [])
        record["padded_tokens"] = int(fb.input_ids.shape[0])
        return (out if isinstance(out, tuple) else (out, None)), record

    result: Dict[str, Any] = {"rank": rank, "world_size": world_size}
    if reference:
        # Complete layer outputs (index i = input of layer i) by forward hooks on a run
        # that captures nothing, as harness.suites.models.reference: independent of the
        # capture code. Meant for TP = 1, where nothing scatters.
        outputs: List[Any] = []
        ref_hook = lambda m, a, o: outputs.append(layer_output(o).clone())  # noqa: E731
        (ref_final, _), record = forward([], ref_hook)
        result.update(
            expected=torch.cat([outputs[i - 1] for i in want], dim=-1).cpu(),
            reference_final=ref_final.cpu().clone(),
            padded_tokens=record["padded_tokens"],
        )
        return result
    seen: List[bool] = []
    scatter_hook = lambda m, a, o: seen.append(bool(get_forward().attn_input_scattered))  # noqa: E731
    (final, aux), record = forward(layers_to_capture, scatter_hook)
    result.update(
        record,
        ran_scattered=any(seen),
        captures=None if aux is None else aux.cpu().clone(),
        num_captured=0 if aux is None else aux.shape[-1] // hidden,
        num_expected=len(want),
        final=final.cpu().clone(),
        end_layer=int(model.end_layer),
    )
    return result


def scattered_capture_matrix(rank: int, world_size: int, cases: Sequence[Dict[str, Any]]):
    """Many cases in one call; a failing case returns its traceback, not raises."""
    out = []
    for case in cases:
        try:
            out.append(scattered_capture_case(rank, world_size, **case))
        except Exception:
            out.append({"rank": rank, "error": traceback.format_exc()})
    return out


def scatter_allowed(rank: int, world_size: int, speculative_algorithm: Optional[str] = "DFLASH",
                    q_lora_rank: Optional[int] = Q_LORA_RANK) -> bool:
    """What SGLang's ``AttnTpContext.init_context`` decides in this rank under
    :func:`attn_tp_input_scattered` (TP > 1, q-lora, not EAGLE3)."""
    with attn_tp_input_scattered(True, q_lora_rank=q_lora_rank,
                                 speculative_algorithm=speculative_algorithm) as ctx:
        return bool(ctx.allow_input_scattered)
