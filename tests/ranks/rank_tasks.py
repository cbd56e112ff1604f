"""Module-level rank tasks for the runner tests (picklable by reference)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def echo(rank, world_size, *args, **kwargs):
    return rank, world_size, args, kwargs, os.getpid()


def raise_on(rank, world_size, bad_rank, text):
    if rank == bad_rank:
        raise ValueError(text)
    return rank


def die_on(rank, world_size, bad_rank, how):
    if rank == bad_rank:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)
    return rank


def hang_here_marker(seconds):
    time.sleep(seconds)


def hang_on(rank, world_size, bad_rank, with_grandchild=False):
    if rank == bad_rank:
        if with_grandchild:
            proc = subprocess.Popen(["sleep", "1000"])
            with open(os.environ["RANKTEST_GRANDCHILD_FILE"] + f".{rank}", "w") as f:
                f.write(str(proc.pid))
        hang_here_marker(1000)
    return rank


def torch_all_reduce(rank, world_size):
    import torch
    import torch.distributed as dist

    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    return x.tolist()


def sglang_collectives(rank, world_size, rows=5, cols=7):
    """All-reduce / all-gather through SGLang's own GroupCoordinators."""
    import torch
    from sglang.srt.distributed import get_tp_group, tensor_model_parallel_all_reduce
    from sglang.srt.layers.dp_attention import get_attention_tp_group

    def part(r):  # exact in float32: small integers
        return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * (r + 1) + r

    expected_sum = sum(part(r) for r in range(world_size))
    tp = get_tp_group()
    attn = get_attention_tp_group()
    a = tensor_model_parallel_all_reduce(part(rank).clone())
    b = attn.all_reduce(part(rank).clone())
    g = attn.all_gather(part(rank), dim=-1)
    expected_gather = torch.cat([part(r) for r in range(world_size)], dim=-1)
    return {
        "tp_sum_exact": bool(torch.equal(a, expected_sum)),
        "attn_sum_exact": bool(torch.equal(b, expected_sum)),
        "attn_gather_exact": bool(torch.equal(g, expected_gather)),
        "tp_size": tp.world_size,
        "tp_rank": tp.rank_in_group,
        "attn_tp_size": attn.world_size,
        "pynccl": tp.pynccl_comm is not None and not tp.pynccl_comm.disabled,
        "ca": tp.ca_comm is not None,
        "device": str(tp.device),
        "sum": a.tolist(),
    }


def sglang_in_process_tp1(rank, world_size):
    """TP = 1 in this process, as a pytest worker uses it; a second init is a no-op."""
    from harness.ranks.sglang import init_sglang_distributed

    cfg1 = init_sglang_distributed(rank=0, world_size=1)
    cfg2 = init_sglang_distributed(rank=0, world_size=1)  # idempotent
    out = sglang_collectives(0, 1)
    from sglang.srt.server_args import get_global_server_args

    out["same_cfg"] = cfg1 is cfg2
    out["server_args_tp"] = get_global_server_args().tp_size
    return out


def raise_or_collective(rank, world_size, bad_rank):
    """bad_rank raises; the others block in a gloo all-reduce that never completes."""
    if rank == bad_rank:
        raise RuntimeError("left the collective")
    return torch_all_reduce(rank, world_size)
