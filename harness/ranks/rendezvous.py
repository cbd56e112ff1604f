"""Rendezvous for a rank pool: a private work dir per pool, a ``file://`` init method in
it, and the init hooks that use it.

Each pool gets its own temp dir, so pools never collide under pytest-xdist. The ranks'
per-rank stack and fatal-signal files live there too. Stdlib only at import time.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def new_workdir(world_size: int) -> str:
    return tempfile.mkdtemp(prefix=f"rankpool-w{world_size}-")


def init_method(workdir: str) -> str:
    """The ``file://`` rendezvous handed to a pool's init hook (a FileStore)."""
    return "file://" + os.path.join(workdir, "rendezvous")


def init_torch_distributed(
    rank: int, world_size: int, *, init_method: str, backend: str = "gloo", **_: Any
) -> None:
    """Plain ``torch.distributed`` init (no SGLang), usable as a pool ``init_fn``."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
