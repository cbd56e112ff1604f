"""SGLang 0.5.23's distributed state in a rank (``init_sglang_distributed``).

The pin's shim (:mod:`harness.ranks.sglang`) sets a global ``ServerArgs``; 0.5.23 reads
its topology and configuration from ``sglang.srt.runtime_context`` instead. The
sequence mirrors SGLang's own test setup (``sglang/test/layer_ut_utils.py``
``init_single_process_dist``):

1. ``parallel_state.init_distributed_environment`` (gloo on CPU, nccl on CUDA), which
   stamps the WORLD group into the runtime context;
2. ``publish_build_topology`` (``sglang/test/test_utils.py``, inlined):
   ``runtime_context.publish`` of a
   ``ServerArgs(model_path="dummy", device=..., tp_size=world_size, ...)`` with this
   rank's ``SpawnRanks`` (the WORLD handle survives the context reset);
3. ``parallel_state.initialize_model_parallel`` at the published widths (TP =
   world_size; attention-TP / MoE groups alias TP);
4. ``initialize_dp_attention`` (attention-DP off) and the gathered-buffer metadata.

Custom all-reduce, mscclpp and torch symm-mem are off; pynccl is off unless the backend
is nccl. SGLang's collective custom ops (``reg_all_gather_into_tensor`` ...) are
registered for the CUDA dispatch key only; CPU kernels doing the same dispatch are
added so gloo ranks run SGLang's own collectives. Idempotent per process.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

# The CPU kernels for SGLang's CUDA-only collective ops are the same dispatch on both
# bases (GroupCoordinator's own torch.distributed calls): the pin's.
from harness.ranks.sglang import (
    DistConfig,
    _log_import,
    _place_process,
    _register_cpu_collectives,
    release_shared_memory,
)

__all__ = ["init_sglang_distributed", "is_initialized", "current_config"]

_STATE: "DistConfig | None" = None


def is_initialized() -> bool:
    return _STATE is not None


def current_config() -> "DistConfig | None":
    return _STATE


def _disable_fast_paths(use_pynccl: bool) -> None:
    from sglang.srt.distributed import parallel_state as ps

    ps.set_custom_all_reduce(False)
    ps.set_mscclpp(False)
    ps.set_torch_symm_mem_all_reduce(False)
    if use_pynccl or getattr(ps, "_auxcap_no_pynccl", False):
        return
    # initialize_model_parallel builds every group through this module-level function
    # and defaults use_pynccl to True off NPU/XPU; PyNcclCommunicator needs CUDA.
    orig = ps.init_model_parallel_group

    def init_model_parallel_group(*args: Any, **kwargs: Any):
        kwargs["use_pynccl"] = False
        kwargs["use_custom_allreduce"] = False
        kwargs["use_mscclpp"] = False
        kwargs["use_torch_symm_mem_allreduce"] = False
        return orig(*args, **kwargs)

    ps.init_model_parallel_group = init_model_parallel_group
    ps._auxcap_no_pynccl = True


def _publish_build_topology(rank: int, fields: dict) -> None:
    """``sglang.test.test_utils.publish_build_topology``, inlined: that module cannot be
    imported in a CPU rank (it indexes ``$CUDA_VISIBLE_DEVICES[0]`` at import, and CPU
    rank pools set it empty) and is heavy. Publish the topology for
    ``initialize_model_parallel``, keeping the WORLD group across the context reset."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", **fields), role="test",
            ranks=SpawnRanks(world_rank=rank))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)


def init_sglang_distributed(
    rank: int = 0,
    world_size: int = 1,
    *,
    init_method: str | None = None,
    backend: str | None = None,
    local_rank: int | None = None,
    hidden_size: int = 64,
    dtype: Any = None,
    server_args_overrides: dict[str, Any] | None = None,
    timeout: int | None = None,
    **_: Any,
) -> DistConfig:
    """Bring up SGLang 0.5.23's world/TP/attention-TP groups at TP = ``world_size``.

    Idempotent: a repeat call in the same process returns the same config (and applies
    ``server_args_overrides`` as runtime-context overrides of resolved config leaves).
    ``server_args_overrides``: extra ``ServerArgs`` fields for the published config
    (e.g. ``{"boundary_reduction": "ar"}``, ``{"enable_attn_tp_input_scattered": True}``).
    ``hidden_size``/``dtype``: the DP gathered-buffer metadata.
    """
    global _STATE
    import torch

    if _STATE is not None:
        if (_STATE.rank, _STATE.world_size) != (rank, world_size):
            raise RuntimeError(
                f"SGLang distributed already initialized as rank {_STATE.rank}/{_STATE.world_size}, "
                f"asked for rank {rank}/{world_size}"
            )
        if server_args_overrides:
            from sglang.srt.runtime_context import get_context

            get_context().override("harness", **server_args_overrides)
        return _STATE

    backend, local_rank, device, init_method = _place_process(
        rank, world_size, backend, local_rank, init_method)

    import time

    first_import = "sglang.srt.distributed.parallel_state" not in sys.modules
    t0 = time.monotonic()
    from sglang.srt.distributed import parallel_state as ps

    _disable_fast_paths(use_pynccl=(backend == "nccl"))
    if backend != "nccl":
        _register_cpu_collectives()

    ps.init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=init_method,
        local_rank=local_rank,
        backend=backend,
        timeout=timeout,
    )

    from sglang.srt.layers.dp_attention import _DpGatheredBufferWrapper, initialize_dp_attention
    from sglang.srt.runtime_context import get_context

    fields: dict[str, Any] = dict(
        device="cuda" if backend == "nccl" else "cpu",
        tp_size=world_size,
        ep_size=1,
        pp_size=1,
        disable_custom_all_reduce=True,
    )
    fields.update(server_args_overrides or {})
    _publish_build_topology(rank, fields)
    ps.initialize_model_parallel(backend=backend)
    initialize_dp_attention(get_context().server_args)
    _DpGatheredBufferWrapper.set_metadata(
        hidden_size=hidden_size, dtype=dtype or torch.float32, device=torch.device(device)
    )

    atexit.register(release_shared_memory)
    _STATE = DistConfig(rank=rank, world_size=world_size, backend=backend, device=device,
                        init_method=init_method)
    _log_import(rank, world_size, first_import, time.monotonic() - t0)
    return _STATE
