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
    # A small integer grid: normalized activations are O(1).
    return (x.to(_torch().float64) * 2).round()


class _ShardedBlock:
    """Column-parallel in, row-parallel out: this rank's partial sum of relu(q W1) W2."""

    def _init_shards(self, seed, tag, hidden, inter, tp_rank, tp_size, dtype):
        torch = _torch()
        w1 = _full_weight(seed, tag, (hidden, inter))
        w2 = _full_weight(seed, tag + 1, (inter, hidden))
        cols = torch.arange(inter).tensor_split(tp_size)[tp_rank]
        self.w1 = w1[:, cols].to(dtype).contiguous()
        self.w2 = w2[cols, :].to(dtype).contiguous()

    def _partial(self, x):
        torch = _torch()
        q = _quantize(x).to(self.w1.dtype)
        return torch.relu(q @ self.w1) @ self.w2
