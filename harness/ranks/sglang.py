"""The smallest shim that brings up SGLang's own distributed state in a rank.

``init_sglang_distributed(rank, world_size, init_method=...)`` sets a default global
``ServerArgs`` (``model_path="dummy"``: SGLang's own short-circuit of the model checks),
turns off custom all-reduce / mscclpp / torch symm-mem (and pynccl when not on CUDA),
then calls SGLang's ``init_distributed_environment`` + ``initialize_model_parallel``
(TP = world_size) and ``initialize_dp_attention``, so ``get_tp_group()``,
``tensor_model_parallel_all_reduce`` and ``get_attention_tp_group()`` are the real
``GroupCoordinator``s. gloo on CPU, nccl + ``cuda:<local_rank>`` when CUDA is present.

Usable as a :class:`harness.ranks.RankPool` ``init_fn``
(``"harness.ranks.sglang:init_sglang_distributed"``) and in-process at world_size 1
(idempotent). Stdlib-only at import time.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

__all__ = [
    "init_sglang_distributed",
    "release_shared_memory",
    "is_initialized",
    "current_config",
    "DistConfig",
]

INIT_FN = "harness.ranks.sglang:init_sglang_distributed"
# What every rank imports first: the modules this shim and the logits processor reach
# (a forkserver's preload lists these and its own; see preload()).
CORE_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.layers.logits_processor",
)
# What CPU rank pools preload in their forkserver (RankPool(preload=...)).
PRELOAD = ("harness.ranks.preload",)

_STATE: "DistConfig | None" = None


class DistConfig(SimpleNamespace):
    rank: int
    world_size: int
    backend: str
    device: str
    init_method: str


def is_initialized() -> bool:
    return _STATE is not None


def current_config() -> "DistConfig | None":
    return _STATE


def release_shared_memory() -> None:
    """Unlink the shm ring buffers of SGLang's message-queue broadcasters (TP groups).

    Their ``__del__`` does it, but ranks leave with ``os._exit``; this runs at exit.
    """
    import sys

    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    if ps is None:
        return
    seen = set()
    for name in ("_WORLD", "_TP", "_ATTN_TP", "_ATTN_CP", "_MOE_EP", "_MOE_TP", "_MOE_DP", "_PP",
                 "_PDMUX_PREFILL_TP_GROUP"):
        group = getattr(ps, name, None)
        mq = getattr(group, "mq_broadcaster", None)
        if mq is None or id(mq) in seen:
            continue
        seen.add(id(mq))
        buf = getattr(mq, "buffer", None)
        shm = getattr(buf, "shared_memory", None)
        if shm is None:
            continue
        try:
            if getattr(buf, "is_creator", False):
                shm.unlink()
            del buf.shared_memory  # keeps ShmRingBuffer.__del__ from a second unlink
            shm.close()
        except Exception:
            pass


def _disable_fast_paths(use_pynccl: bool) -> None:
    from sglang.srt.distributed import parallel_state as ps

    ps.set_custom_all_reduce(False)
    ps.set_mscclpp_all_reduce(False)
    ps.set_torch_symm_mem_all_reduce(False)
    if use_pynccl or getattr(ps, "_auxcap_no_pynccl", False):
        return
    # initialize_model_parallel builds its groups through this module-level function and
    # defaults use_pynccl to True; PyNcclCommunicator needs CUDA. Force it off on CPU.
    orig = ps.init_model_parallel_group

    def init_model_parallel_group(*args: Any, **kwargs: Any):
        kwargs["use_pynccl"] = False
        kwargs["use_custom_allreduce"] = False
        kwargs["use_mscclpp_allreduce"] = False
        kwargs["use_torch_symm_mem_allreduce"] = False
        return orig(*args, **kwargs)

    ps.init_model_parallel_group = init_model_parallel_group
    ps._auxcap_no_pynccl = True


_CPU_COLLECTIVES = {
    # SGLang registers these torch custom ops for the CUDA dispatch key only; each is a
    # thin dispatcher to the GroupCoordinator's own torch.distributed call. The CPU
    # kernels below are the same dispatch, so gloo ranks run SGLang's own collectives.
    "reg_all_gather_into_tensor": "_all_gather_into_tensor",
    "reg_reduce_scatter_tensor": "_reduce_scatter_tensor",
    "reg_all_to_all_single": "_all_to_all_single",
}
_CPU_LIB = None


def _register_cpu_collectives() -> None:
    global _CPU_LIB
    if _CPU_LIB is not None:
        return
    import torch
    from sglang.srt.distributed import parallel_state as ps

    lib = torch.library.Library("sglang", "IMPL")
    for op_name, method in _CPU_COLLECTIVES.items():
        wrapper = getattr(ps, op_name, None)
        if wrapper is None:
            continue
        getattr(wrapper, "real_impl", None)  # defines torch.ops.sglang.<op> if needed
        if not hasattr(torch.ops.sglang, op_name):
            continue

        def kernel(output, input, group_name, _method=method):
            group = ps._groups[group_name]()
            if group is None:
                raise ValueError(f"Group {group_name} is destroyed.")
            getattr(group, _method)(output, input)

        lib.impl(op_name, kernel, "CPU")
    _CPU_LIB = lib


def _place_process(rank: int, world_size: int, backend: str | None, local_rank: int | None,
                   init_method: str | None) -> tuple[str, int, str, str]:
    """What every base does before it brings SGLang's groups up in this process: dynamo
    off for SGLang's small compiled helpers, the backend and device, the rendezvous.
    Returns ``(backend, local_rank, device, init_method)``."""
    import torch

    if os.environ.get("HARNESS_TORCH_COMPILE") != "1":
        # SGLang wraps a few small helpers in torch.compile (e.g. the vocab-parallel
        # embedding's input masking, which runs only at TP > 1); inductor then builds
        # C++ for them in every rank, ~20 s each on 2 cores. They are not what the
        # suites test, so they run eagerly. The fullgraph checks turn dynamo back on
        # for their own compile; HARNESS_TORCH_COMPILE=1 keeps it on everywhere.
        torch._dynamo.config.disable = True

    on_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if on_cuda else "gloo")
    if backend == "nccl" and not on_cuda:
        raise RuntimeError("backend nccl requested but CUDA is not available")
    local_rank = rank if local_rank is None else local_rank
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if init_method is None:
        if world_size != 1:
            raise ValueError("init_method is required for world_size > 1")
        init_method = "file://" + os.path.join(tempfile.mkdtemp(prefix="sglang-dist-"), "rendezvous")
    os.environ.pop("LOCAL_SIZE", None)  # keeps the CPU all-reduce on torch.distributed (gloo)
    return backend, local_rank, device, init_method


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
    """Bring up SGLang's world/TP/attention-TP groups at TP = ``world_size``. Idempotent.

    ``hidden_size``/``dtype`` feed ``initialize_dp_attention``'s gathered-buffer metadata.
    ``server_args_overrides``: extra ``ServerArgs`` fields (e.g.
    ``{"enable_flashinfer_allreduce_fusion": True}``); also re-applied on repeat calls.
    """
    global _STATE
    import torch

    from harness.standins import bases

    other = bases.module("dist")
    if other is not None:  # another base brings its SGLang up its own way
        return other.init_sglang_distributed(
            rank, world_size, init_method=init_method, backend=backend, local_rank=local_rank,
            hidden_size=hidden_size, dtype=dtype, server_args_overrides=server_args_overrides,
            timeout=timeout,
        )
    if _STATE is not None:
        if (_STATE.rank, _STATE.world_size) != (rank, world_size):
            raise RuntimeError(
                f"SGLang distributed already initialized as rank {_STATE.rank}/{_STATE.world_size}, "
                f"asked for rank {rank}/{world_size}"
            )
        if server_args_overrides:
            from sglang.srt.server_args import get_global_server_args

            sa = get_global_server_args()
            for k, v in server_args_overrides.items():
                setattr(sa, k, v)
        return _STATE

    backend, local_rank, device, init_method = _place_process(
        rank, world_size, backend, local_rank, init_method)

    import time

    first_import = "sglang.srt.server_args" not in sys.modules
    t0 = time.monotonic()
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    sa_kwargs: dict[str, Any] = dict(
        model_path="dummy",
        device="cuda" if backend == "nccl" else "cpu",
        tp_size=world_size,
        disable_custom_all_reduce=True,
    )
    server_args = ServerArgs(**sa_kwargs)
    for k, v in (server_args_overrides or {}).items():
        setattr(server_args, k, v)
    set_global_server_args_for_scheduler(server_args)

    _disable_fast_paths(use_pynccl=(backend == "nccl"))
    if backend != "nccl":
        _register_cpu_collectives()

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    ps.init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=init_method,
        local_rank=local_rank,
        backend=backend,
        timeout=timeout,
    )
    # ``server_args_overrides={"ep_size": N}`` splits the MoE groups as the engine does.
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                 expert_model_parallel_size=server_args.ep_size)
    model_config = SimpleNamespace(hidden_size=hidden_size, dtype=dtype or torch.float32)
    initialize_dp_attention(server_args, model_config)

    atexit.register(release_shared_memory)
    _STATE = DistConfig(rank=rank, world_size=world_size, backend=backend, device=device,
                        init_method=init_method)
    _log_import(rank, world_size, first_import, time.monotonic() - t0)
    return _STATE


def preload(modules: tuple[str, ...]) -> None:
    """A forkserver's preload: import ``modules`` once (a module that the SGLang under
    test lacks, on another base, is skipped: the rank imports what it needs), logged as
    rank -1. Nothing is initialised (no process group, no CUDA)."""
    import importlib
    import time

    t0 = time.monotonic()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    _log_import(-1, 0, True, time.monotonic() - t0)


def _log_import(rank: int, world_size: int, first_import: bool, seconds: float) -> None:
    """With ``$HARNESS_IMPORT_LOG``, one JSON line per process that brings SGLang up
    (``make bench-suite`` counts them: the suites import SGLang once per process)."""
    path = os.environ.get("HARNESS_IMPORT_LOG")
    if not path:
        return
    import json

    line = json.dumps({"pid": os.getpid(), "rank": rank, "world_size": world_size,
                       "imported_sglang": first_import, "seconds": round(seconds, 2),
                       "sglang_path": os.environ.get("HARNESS_SGLANG_PATH", "")})
    with open(path, "a") as f:
        f.write(line + "\n")
