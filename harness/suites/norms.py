"""Cases on SGLang's real fused all-reduce + residual + RMSNorm entry, runnable in any rank.

``RMSNorm.forward_with_allreduce_fusion`` serves a layer whose previous layer deferred
its all-reduce: ``x`` is each rank's partial sum. :func:`fused_norm_declined` runs it
with the FlashInfer kernel declining (as it does without a workspace or on a
non-contiguous input) and returns what it produced beside the norm of the complete
sum, so every rank can be checked against the same expectation. Inputs are small
integers in float64, so the sums are exact whatever order the all-reduce takes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

HIDDEN = 16
TOKENS = 5


@contextlib.contextmanager
def _flashinfer_declines() -> Iterator[None]:
    from sglang.srt.layers import flashinfer_comm_fusion

    saved = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm
    flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm = lambda **_: (None, None)
    try:
        yield
    finally:
        flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm = saved


def fused_norm_declined(rank: int, world_size: int, *, with_addition: bool,
                        use_attn_tp_group: bool) -> Dict[str, Any]:
    """The fused norm's output when FlashInfer declines, and what it should be."""
    import torch
    from sglang.srt.layers.layernorm import RMSNorm

    from harness.standins.kernels import _rms, install_cpu_norm

    g = torch.Generator().manual_seed(3)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-4, 5, shape, generator=g).to(torch.float64)

    full = ints(TOKENS, HIDDEN)
    # Partial sums that add up to ``full`` over the ranks: rank 0 holds the rest.
    shares = [ints(TOKENS, HIDDEN) for _ in range(world_size - 1)]
    partial = full - sum(shares) if rank == 0 else shares[rank - 1]
    residual = ints(TOKENS, HIDDEN)
    addition = ints(TOKENS, HIDDEN) if with_addition else None
    residual_in = residual.clone()

    norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.float64)
    with torch.no_grad():
        norm.weight.copy_(ints(HIDDEN).abs() + 1)
    install_cpu_norm(norm)  # the CUDA kernels' aliasing: fused_add_rmsnorm is in place
    with torch.no_grad(), _flashinfer_declines():
        out, residual_out = norm.forward_with_allreduce_fusion(
            partial.clone(), residual, post_residual_addition=addition,
            use_attn_tp_group=use_attn_tp_group)
    want_residual = full + residual_in + (addition if addition is not None else 0)
    return {
        "rank": rank,
        "out": out.clone(),
        "residual_out": residual_out.clone(),
        "want_out": _rms(want_residual, norm.weight.data, norm.variance_epsilon),
        "want_residual": want_residual,
        "residual_untouched": torch.equal(residual, residual_in),
    }
