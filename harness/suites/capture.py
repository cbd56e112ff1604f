"""Aux-capture cases on SGLang's real DeepseekV2Model, runnable in any rank.

Each function here is module-level so a :class:`harness.ranks.RankPool` can run it
in every rank (``fn(rank, world_size, ...)``) and also in-process at TP = 1. A
model is built once per rank and configuration and reused across cases.

The reference for a capture index ``i`` is the output of layer ``i - 1``
(``hidden_states + residual`` once the layer's all-reduce is complete; the
embedding for ``i = 0``), taken with forward hooks on a run with fusion off and no
capture at all, so it does not depend on the capture code under test.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence

from harness.standins.batch import attn_tp_input_scattered
from harness.standins.blocks import TinyConfig
from harness.standins.deepseek_v2 import build_tiny_deepseek, run_model
from harness.standins.kernels import fusion_mode

_MODELS: Dict[TinyConfig, Any] = {}


def get_model(cfg: TinyConfig = TinyConfig()):
    if cfg not in _MODELS:
        _MODELS[cfg] = build_tiny_deepseek(cfg)
    return _MODELS[cfg]


def input_ids(num_tokens: int, cfg: TinyConfig = TinyConfig(), seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (num_tokens,), generator=g)


def layer_sets(num_layers: int) -> Dict[str, List[int]]:
    """The layers_to_capture variants of the matrix, as SGLang computes them."""
    return {
        # set_eagle3_layers_to_capture(None): [2, n // 2, n - 3]
        "eagle3-default": [2, num_layers // 2, num_layers - 3],
        # set_eagle3_layers_to_capture(ids) with the last layer: [id + 1 for id in ids]
        "eagle3-last": [1 + 1, (num_layers // 2) + 1, (num_layers - 1) + 1],
        # set_dflash_layers_to_capture(ids): [id + 1 for id in ids]
        "dflash": [0 + 1, 2 + 1, (num_layers - 2) + 1, (num_layers - 1) + 1],
    }


def as_packed(aux) -> Any:
    """Captures as one [tokens, K * hidden] tensor, whichever form the model returned."""
    import torch

    if aux is None:
        return None
    if isinstance(aux, torch.Tensor):
        return aux
    return torch.cat(list(aux), dim=-1)


def num_captured(aux, hidden_size: int) -> int:
    if aux is None:
        return 0
    return as_packed(aux).shape[-1] // hidden_size


class ListCollector(list):
    """An unmigrated model's collector: a plain list (no copy on append)."""

    def finalize(self):
        import torch

        return torch.cat(self, dim=-1)


class _Snapshots:
    """Remembers (tensor, value at append time) for every capture."""

    def __init__(self):
        self.items: List[Any] = []

    def record(self, t):
        self.items.append((t, t.clone()))

    def changed_later(self) -> List[int]:
        """Indices of appended tensors whose value changed after they were appended."""
        import torch

        return [i for i, (t, snap) in enumerate(self.items) if not torch.equal(t, snap)]


@contextlib.contextmanager
def collector(kind: str, snapshots: Optional[_Snapshots] = None):
    """Run the model with the given collector: ``packer`` (the model's own) or
    ``list`` (an unmigrated model's list). With ``snapshots``, every appended tensor
    is recorded with its value at append time."""
    import unittest.mock as mock

    from sglang.srt.models import deepseek_v2

    if kind not in ("packer", "list"):
        raise ValueError(f"collector {kind!r}")
    packer_cls = getattr(deepseek_v2, "AuxHiddenStatePacker", None)
    if packer_cls is None:
        # Before the packer patch the model builds a plain list itself.
        if snapshots is None:
            yield
            return

        class SnapList(list):
            def append(self, t):
                snapshots.record(t)
                super().append(t)

        orig_forward = deepseek_v2.DeepseekV2DecoderLayer.forward

        def forward(self, *args, captured_last_layer_outputs=None, **kwargs):
            if captured_last_layer_outputs is not None and not isinstance(
                captured_last_layer_outputs, SnapList
            ):
                captured_last_layer_outputs.__class__ = SnapList
            return orig_forward(
                self, *args, captured_last_layer_outputs=captured_last_layer_outputs, **kwargs
            )

        if "captured_last_layer_outputs" in orig_forward.__code__.co_varnames:
            with mock.patch.object(deepseek_v2.DeepseekV2DecoderLayer, "forward", forward):
                yield
        else:
            yield
        return
    if kind == "list":
        base = ListCollector
    else:
        base = packer_cls

    if snapshots is None and kind == "packer":
        yield
        return

    class Instrumented(base):
        def append(self, t):
            if snapshots is not None:
                snapshots.record(t)
            super().append(t)

    factory = (lambda n: Instrumented()) if kind == "list" else Instrumented
    with mock.patch.object(deepseek_v2, "AuxHiddenStatePacker", factory):
        yield


def reference_layer_outputs(model, ids) -> List[Any]:
    """Complete output of every layer (index i = input of layer i), fusion off."""

    outputs: List[Any] = []

    def hook(module, args, kwargs, out):
        h, r = out[0], out[1]
        outputs.append((h if r is None else h + r).clone())

    emb_out: List[Any] = []
    handles = [
        model.embed_tokens.register_forward_hook(lambda m, a, o: emb_out.append(o.clone()))
    ]
    for layer in model.layers:
        handles.append(layer.register_forward_hook(hook, with_kwargs=True))
    try:
        with fusion_mode("off"):
            final, _ = run_model(model, ids, [])
    finally:
        for h in handles:
            h.remove()
    return [emb_out[0]] + outputs, final


def capture_case(
    rank: int,
    world_size: int,
    *,
    num_tokens: int,
    layers_to_capture: Sequence[int],
    fusion: str = "off",
    collector_kind: str = "packer",
    mode: str = "extend",
    input_scattered: bool = False,
    cfg: TinyConfig = TinyConfig(),
) -> Dict[str, Any]:
    """Runs one capture case; returns plain data for cross-rank comparison."""
    import torch

    model = get_model(cfg)
    ids = input_ids(num_tokens, cfg)
    refs, ref_final = reference_layer_outputs(model, ids)
    snaps = _Snapshots()
    with fusion_mode(fusion), collector(collector_kind, snaps), attn_tp_input_scattered(
        input_scattered
    ):
        final, aux = run_model(model, ids, layers_to_capture, mode=mode)
    packed = as_packed(aux)
    expected = [refs[i] for i in sorted(set(layers_to_capture)) if i < len(refs)]
    appended = [t for t, _ in snaps.items]
    shares_final = [
        i
        for i, t in enumerate(appended + ([] if packed is None else [packed]))
        if t.untyped_storage().data_ptr() == final.untyped_storage().data_ptr()
    ]
    return {
        "rank": rank,
        "world_size": world_size,
        "captures": None if packed is None else packed.cpu().clone(),
        "expected": torch.cat(expected, dim=-1).cpu() if expected else None,
        "num_expected": len(expected),
        "num_captured": num_captured(aux, cfg.hidden_size),
        "returned_packed": isinstance(aux, torch.Tensor),
        "final": final.cpu().clone(),
        "reference_final": ref_final.cpu().clone(),
        "changed_after_capture": snaps.changed_later(),
        "shares_storage_with_final": shares_final,
    }


def capture_matrix(rank: int, world_size: int, cases: Sequence[Dict[str, Any]]):
    """Runs many cases in one call; a failing case returns its traceback, not raises."""
    import traceback

    out = []
    for case in cases:
        try:
            out.append(capture_case(rank, world_size, **case))
        except Exception:
            out.append({"rank": rank, "error": traceback.format_exc()})
    return out


def ag_after_qlora_capture(rank: int, world_size: int, num_tokens_per_rank: int = 3):
    """A layer whose input is SCATTERED (a2a MoE) with SGLANG_USE_AG_AFTER_QLORA: the
    communicator's attention input stays scattered; the capture must be gathered.

    Returns (captured, expected full residual) as CPU tensors.
    """
    import unittest.mock as mock

    import torch
    from sglang.srt.layers import communicator as comm_mod
    from sglang.srt.layers.communicator import (
        LayerCommunicator,
        LayerScatterModes,
        ScatterMode,
    )
    from sglang.srt.layers.layernorm import RMSNorm

    from harness.standins.batch import make_forward_batch
    from harness.standins.kernels import device, has_real_kernels, install_cpu_norm

    hidden = 16
    modes = LayerScatterModes(
        layer_input_mode=ScatterMode.SCATTERED,
        attn_mode=ScatterMode.TP_ATTN_FULL,
        mlp_mode=ScatterMode.SCATTERED,
        middle_residual_mode=ScatterMode.SCATTERED,
        layer_output_mode=ScatterMode.SCATTERED,
    )
    norms = torch.nn.ModuleList([RMSNorm(hidden), RMSNorm(hidden)]).to(torch.float64)
    norms.to(device())
    if not has_real_kernels():
        install_cpu_norm(norms)
    with mock.patch.object(comm_mod, "_use_ag_after_qlora", True):
        comm = LayerCommunicator(
            layer_scatter_modes=modes,
            input_layernorm=norms[0],
            post_attention_layernorm=norms[1],
        )
    total = num_tokens_per_rank * world_size
    full_h = torch.arange(total * hidden, dtype=torch.float64).reshape(total, hidden) % 7
    full_r = torch.arange(total * hidden, dtype=torch.float64).reshape(total, hidden) % 5
    sl = slice(rank * num_tokens_per_rank, (rank + 1) * num_tokens_per_rank)
    h = full_h[sl].clone().to(device())
    r = full_r[sl].clone().to(device())
    fb = make_forward_batch(torch.zeros(num_tokens_per_rank, dtype=torch.int64, device=device()))
    from sglang.srt.layers.dp_attention import _DpGatheredBufferWrapper as dp_buf

    saved = {k: getattr(dp_buf, k, None) for k in
             ("_hidden_size", "_dtype", "_device", "_global_dp_buffer_len",
              "_local_dp_buffer_len", "_dp_max_padding", "_global_num_tokens")}
    try:
        dp_buf.set_metadata(hidden, torch.float64, torch.device(device()))
        dp_buf.set_dp_buffer_len(total, total, False)
        captured = []
        hs, _ = comm.prepare_attn_and_capture_last_layer_outputs(
            h, r, fb, captured_last_layer_outputs=captured
        )
    finally:
        for k, v in saved.items():
            setattr(dp_buf, k, v)
    return {
        "attn_input_rows": int(hs.shape[0]),
        "captured": captured[0].cpu().clone(),
        "expected": (full_h + full_r),
    }
