"""Exact, TP-sharded compute blocks that stand in for attention and MLP/MoE kernels.

Exactness: weights are small integers and the blocks round their (normalized) input
to a small integer grid before multiplying, so every partial sum, and every all-reduce
of partial sums, is an integer held exactly in float64. TP = 1, 2 and 4 therefore give
bit-identical results, whatever the reduction order.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from harness.standins.kernels import _torch


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    num_layers: int = 8
    hidden_size: int = 16
    intermediate_size: int = 32
    vocab_size: int = 64
    seed: int = 1234
    dtype: str = "float64"
    first_k_dense_replace: int = 0


def _full_weight(seed: int, tag: int, shape: Sequence[int]):
    torch = _torch()
    g = torch.Generator().manual_seed(seed * 1000 + tag)
    return torch.randint(-1, 2, tuple(shape), generator=g).to(torch.float64)


def _quantize(x):
    # A small integer grid: normalized activations are O(1). In the input's dtype: exact
    # for float64 / float32 (and no float64 temporaries in the memory benchmarks).
    return (x * 2).round()


class _ShardedBlock:
    """Column-parallel in, row-parallel out: this rank's partial sum of relu(q W1) W2."""

    def _init_shards(self, seed, tag, hidden, inter, tp_rank, tp_size, dtype):
        torch = _torch()
        w1 = _full_weight(seed, tag, (hidden, inter))
        w2 = _full_weight(seed, tag + 1, (inter, hidden))
        cols = torch.arange(inter).tensor_split(tp_size)[tp_rank]
        w1 = w1[:, cols].to(dtype).contiguous()
        w2 = w2[cols, :].to(dtype).contiguous()
        if isinstance(self, torch.nn.Module):  # buffers follow model.to(device, dtype)
            self.register_buffer("w1", w1, persistent=False)
            self.register_buffer("w2", w2, persistent=False)
        else:
            self.w1, self.w2 = w1, w2

    def _partial(self, x):
        torch = _torch()
        q = _quantize(x).to(self.w1.dtype)
        return torch.relu(q @ self.w1) @ self.w2


# How a stand-in finishes its partial sum, mirroring the module it replaces:
#   SELF:      its row-parallel output projection has reduce_results=True (o_proj /
#              down_proj all-reduce inside the module);
#   NONE:      reduce_results=False: the LayerCommunicator (or the decoder layer)
#              all-reduces;
#   DEFERABLE: all-reduces unless the caller defers it (``should_allreduce_fusion``:
#              fused into the next layer's norm; ``use_reduce_scatter``), as
#              ``RowParallelLinear(skip_all_reduce=...)`` and the MoE blocks do.
REDUCE_SELF = "self"
REDUCE_NONE = "none"
REDUCE_DEFERABLE = "deferable"
_HIDDEN_NAMES = ("hidden_states", "x", "hidden_state", "input_", "input")


def _bind(sig, args, kwargs) -> dict:
    try:
        bound = sig.bind_partial(None, *args, **kwargs)
    except TypeError:
        return dict(kwargs)
    return dict(bound.arguments)


def standin_class(orig_cls: type, cfg: "TinyConfig", reduce: str, attrs: dict | None = None) -> type:
    """A TP-sharded stand-in for ``orig_cls`` (an attention or MLP/MoE module).

    It accepts the original constructor and forward arguments (bound by the original
    signatures), derives its weights from its ``prefix`` (so every module of a model gets
    its own weights, identical at every TP size), and returns ``relu(q W1) W2`` of its
    hidden-states argument: this rank's partial sum, reduced as ``reduce`` says. Rows
    are independent, so the capture semantics do not depend on token mixing.
    """
    import inspect
    import zlib

    torch = _torch()
    init_sig = inspect.signature(orig_cls.__init__)
    fwd_sig = inspect.signature(orig_cls.forward)
    if reduce not in (REDUCE_SELF, REDUCE_NONE, REDUCE_DEFERABLE):
        raise ValueError(f"reduce {reduce!r}")

    class StandIn(torch.nn.Module, _ShardedBlock):
        auxcap_stands_in_for = orig_cls.__qualname__

        def __init__(self, *args, **kwargs):
            from sglang.srt.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            from harness.standins.kernels import model_dtype

            torch.nn.Module.__init__(self)
            bound = _bind(init_sig, args, kwargs)
            key = bound.get("prefix") or f"{orig_cls.__name__}.{bound.get('layer_id')}"
            self.auxcap_key = key
            self.tp_size = get_tensor_model_parallel_world_size()
            self._init_shards(cfg.seed, zlib.crc32(key.encode()), cfg.hidden_size,
                              cfg.intermediate_size, get_tensor_model_parallel_rank(),
                              self.tp_size, model_dtype(cfg))
            for name, value in (attrs or {}).items():
                setattr(self, name, value)

        def prepare_qkv_latent(self, hidden_states, forward_batch):
            return hidden_states

        def forward(self, *args, **kwargs):
            from sglang.srt.distributed import tensor_model_parallel_all_reduce

            bound = _bind(fwd_sig, args, kwargs)
            x = next((bound[n] for n in _HIDDEN_NAMES if n in bound), None)
            if x is None:
                raise TypeError(f"stand-in for {orig_cls.__qualname__}: no hidden states in "
                                f"{sorted(bound)}")
            if x.shape[0] == 0:
                return x.clone()
            out = self._partial(x)
            deferred = bool(bound.get("should_allreduce_fusion")) or bool(bound.get("use_reduce_scatter"))
            if self.tp_size > 1 and (reduce == REDUCE_SELF or (reduce == REDUCE_DEFERABLE and not deferred)):
                out = tensor_model_parallel_all_reduce(out)
            return out

    # The two-batch-overlap operations of the real module (``op_prepare``, ``op_gate``,
    # ...): SGLang's TBO plan lists them, so the stand-in has exactly those names. The
    # harness's TBO executor runs the layers themselves, never these operations.
    for op_name in (n for n in dir(orig_cls) if n.startswith("op_")):
        setattr(StandIn, op_name, _not_run(orig_cls.__name__, op_name))
    StandIn.__name__ = StandIn.__qualname__ = f"StandIn{orig_cls.__name__}"
    return StandIn


def _not_run(cls_name: str, op_name: str):
    def op(self, state):
        raise RuntimeError(f"stand-in {cls_name}.{op_name}: the harness runs whole layers, "
                           "not two-batch-overlap operations")

    op.__name__ = op_name
    return op
