"""KV cache copy on the CPU: ``copy_all_layer_kv_cache``.

Definition: SGLang's Triton kernel ``copy_all_layer_kv_cache_tiled`` (pin
``mem_cache/memory_pool.py``; 0.5.23 ``kernels/ops/kvcache/cache_move.py``, whose CPU
branch calls sgl-kernel's ``copy_all_layer_kv_cache_cpu`` with the same arguments). For
every buffer b (one K or V buffer per layer), given by its base address
``data_ptrs[b]`` and its row size in bytes ``strides[b]``: row ``tgt_loc[i]`` gets the
bytes of row ``src_loc[i]``, every source row read before any target row is written
(the kernel loads a tile, then stores it). The pool's warm-up calls it with
``tgt == src``.

The kernel addresses raw device memory, and so does this version: a byte view over
each buffer's first ``max(loc) + 1`` rows, built from the address with ctypes. Under
Triton's interpreter the kernel itself fails on those addresses ("0 active drivers"),
which is why the pin's pool warm-up needed ``SGLANG_NATIVE_MOVE_KV_CACHE``.

``TiledCopyLauncher`` stands in for the Triton kernel object (``kernel[grid](...)``),
for the pin, whose pool launches the kernel directly.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    op = "copy_all_layer_kv_cache"
    if data_ptrs.numel() != strides.numel():
        raise ValueError(f"{op}: {data_ptrs.numel()} buffers but {strides.numel()} strides")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"{op}: {tgt_loc.numel()} target rows but {src_loc.numel()} source rows")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).long().cpu()
    src = src_loc.reshape(-1).long().cpu()
    if int(tgt.min()) < 0 or int(src.min()) < 0:
        raise ValueError(f"{op}: negative row index")
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        if ptr == 0 or stride <= 0:
            raise ValueError(f"{op}: buffer at {ptr:#x} with row stride {stride}")
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src]  # gather, then scatter


class TiledCopyLauncher:
    """``copy_all_layer_kv_cache_tiled[grid](data_ptrs, strides, tgt_loc, src_loc,
    num_locs, num_locs_upper, BYTES_PER_TILE=..., ...)`` on the CPU: copies the first
    ``num_locs`` rows (tiling and launch parameters do not change the result)."""

    def __getitem__(self, grid: Any) -> "TiledCopyLauncher":
        return self

    def __call__(self, data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                 src_loc: torch.Tensor, num_locs: int, num_locs_upper: int, **launch: Any) -> None:
        n = int(num_locs)
        copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc.reshape(-1)[:n], src_loc.reshape(-1)[:n])
