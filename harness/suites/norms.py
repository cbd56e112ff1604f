"""Cases on SGLang's real fused all-reduce + residual + RMSNorm entry, runnable in any rank.

``RMSNorm.forward_with_allreduce_fusion`` serves a layer whose previous layer deferred
its all-reduce: ``x`` is each rank's partial sum. :func:`fused_norm_declined` runs it
with the FlashInfer kernel declining (as it does without a workspace or on a
non-contiguous input), and :func:`unfused_deferred_prepare_attn` runs the pin's
``LayerCommunicator.prepare_attn`` where the fusion does not apply to a deferred sum;
each returns what it produced beside the norm of the complete sum, so every rank can be
checked against the same expectation. Inputs are small integers in float64, so the
sums are exact whatever order the all-reduce takes. :func:`init_ep` brings a rank up
with expert parallelism over the whole world (EP = TP, the MoE tensor parallel group of
size 1): the fused kernel then reduces a deferred MoE output over the EP group.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

HIDDEN = 16
TOKENS = 5


def init_ep(rank: int, world_size: int, **kwargs: Any):
    """Rank pool init hook: SGLang's distributed state with ``ep_size`` = the world."""
    from harness.ranks.sglang import init_sglang_distributed

    return init_sglang_distributed(rank, world_size, server_args_overrides={"ep_size": world_size},
                                   **kwargs)


def _groups() -> Dict[str, int]:
    from sglang.srt.distributed import parallel_state as ps

    return {"moe_ep": ps.get_moe_ep_group().world_size, "moe_tp": ps.get_moe_tp_group().world_size}


def _ints(g, *shape: int):
    import torch

    return torch.randint(-4, 5, shape, generator=g).to(torch.float64)


def _partial_sums(rank: int, world_size: int):
    """(this rank's share, the complete sum, a residual): shares add up to the sum."""
    import torch

    g = torch.Generator().manual_seed(3)
    full = _ints(g, TOKENS, HIDDEN)
    # Partial sums that add up to ``full`` over the ranks: rank 0 holds the rest.
    shares = [_ints(g, TOKENS, HIDDEN) for _ in range(world_size - 1)]
    partial = full - sum(shares) if rank == 0 else shares[rank - 1]
    return partial, full, _ints(g, TOKENS, HIDDEN), g


def _norm(g):
    import torch
    from sglang.srt.layers.layernorm import RMSNorm

    from harness.standins.kernels import install_cpu_norm

    norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.float64)
    with torch.no_grad():
        norm.weight.copy_(_ints(g, HIDDEN).abs() + 1)
    install_cpu_norm(norm)  # the CUDA kernels' aliasing: fused_add_rmsnorm is in place
    return norm


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

    from harness.standins.kernels import _rms

    partial, full, residual, g = _partial_sums(rank, world_size)
    addition = _ints(g, TOKENS, HIDDEN) if with_addition else None
    residual_in = residual.clone()
    norm = _norm(g)
    with torch.no_grad(), _flashinfer_declines():
        out, residual_out = norm.forward_with_allreduce_fusion(
            partial.clone(), residual, post_residual_addition=addition,
            use_attn_tp_group=use_attn_tp_group)
    want_residual = full + residual_in + (addition if addition is not None else 0)
    return {
        "rank": rank,
        "groups": _groups(),
        "out": out.clone(),
        "residual_out": residual_out.clone(),
        "want_out": _rms(want_residual, norm.weight.data, norm.variance_epsilon),
        "want_residual": want_residual,
        "residual_untouched": torch.equal(residual, residual_in),
    }


def unfused_deferred_prepare_attn(rank: int, world_size: int) -> Dict[str, Any]:
    """The pin's ``LayerCommunicator.prepare_attn`` on a partial sum the previous layer
    deferred (``_sglang_needs_allreduce_fusion``) where the fusion does not apply (the
    FlashInfer and aiter predicates are off): its unfused branch must reduce it over
    the group the fused kernel would have, then add and norm."""
    import torch
    from sglang.srt.layers.communicator import (
        LayerCommunicator,
        LayerScatterModes,
        ScatterMode,
    )

    from harness.standins.batch import make_forward_batch
    from harness.standins.kernels import _rms

    partial, full, residual, g = _partial_sums(rank, world_size)
    norms = [_norm(g), _norm(g)]
    comm = LayerCommunicator(
        layer_scatter_modes=LayerScatterModes(
            layer_input_mode=ScatterMode.TP_ATTN_FULL, attn_mode=ScatterMode.TP_ATTN_FULL,
            mlp_mode=ScatterMode.TP_ATTN_FULL, middle_residual_mode=ScatterMode.TP_ATTN_FULL,
            layer_output_mode=ScatterMode.TP_ATTN_FULL),
        input_layernorm=norms[0], post_attention_layernorm=norms[1])
    hidden = partial.clone()
    hidden._sglang_needs_allreduce_fusion = True
    fb = make_forward_batch(torch.zeros(TOKENS, dtype=torch.int64))
    want_residual = full + residual
    with torch.no_grad():
        out, residual_out = comm.prepare_attn(hidden, residual.clone(), fb)
    return {
        "rank": rank,
        "groups": _groups(),
        "out": out.clone(),
        "residual_out": residual_out.clone(),
        "want_out": _rms(want_residual, norms[0].weight.data, norms[0].variance_epsilon),
        "want_residual": want_residual,
        "residual_untouched": True,
    }


def all_reduce_modes(rank: int, world_size: int, groups=("tp", "attn_tp")) -> list:
    """SGLang's ``tensor_model_parallel_all_reduce`` (and the attention-TP one) under each
    all-reduce mode of :func:`harness.standins.kernels.allreduce_mode`, on this rank's
    partial sums: per (mode, group), whether the result is the input tensor, whether the
    input was left as it was, whether the result is the complete sum, and how many
    custom all-reduces ran."""
    from sglang.srt.distributed import (
        attention_tensor_model_parallel_all_reduce,
        tensor_model_parallel_all_reduce,
    )

    from harness.standins import kernels

    reduce = {"tp": tensor_model_parallel_all_reduce,
              "attn_tp": attention_tensor_model_parallel_all_reduce}
    out = []
    for mode in kernels.ALLREDUCE_MODES:
        for group in groups:
            partial, full, _residual, _g = _partial_sums(rank, world_size)
            before, counted = partial.clone(), kernels.PATHS.copy()
            with kernels.allreduce_mode(mode):
                result = reduce[group](partial)
            out.append({"rank": rank, "mode": mode, "group": group,
                        "same_tensor": result is partial,
                        "input_untouched": bool((partial == before).all()),
                        "complete_sum": bool((result == full).all()),
                        "custom": kernels.paths_since(counted).get("custom_all_reduce", 0)})
    return out
