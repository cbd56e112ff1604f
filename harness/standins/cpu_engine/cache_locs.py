"""KV cache-location ops on the CPU: which KV slots a request's tokens use.

Definitions: SGLang's own Triton kernels, which the ``*_cpu`` ops of sgl-kernel's CPU
build mirror (SGLang 0.5.23 calls the CPU op where it would launch the kernel):

- ``assign_req_to_token_pool`` (``mem_cache/allocation.py``): write each request's
  newly allocated slots into its row of ``req_to_token``;
- ``assign_extend_cache_locs`` (``kernels/ops/speculative/cache_locs.py``; at the pin
  ``speculative/triton_ops/cache_locs.py``): the reverse, read a span of each row into
  one packed ``out_cache_loc``;
- ``assign_draft_cache_locs_contiguous``: read ``topk * num_cols`` slots from
  ``seq_lens[i]`` on, into request i's block of ``out_cache_loc``;
- ``fill_bonus_tokens`` and ``fill_accept_out_cache_loc``
  (``kernels/ops/speculative/eagle.py``): after a verify, each request's last accepted
  token, and the slots of the accepted tokens packed to the front.

``req_to_token`` is read as the kernels read it: flat, ``pool_len`` entries a row.
The batch is ``req_pool_indices`` (the kernels' grid); a shorter ``start``/``end``
tensor is refused, as is a ``pool_len`` that disagrees with the table.
"""

from __future__ import annotations

import torch


def _rows(op: str, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, pool_len: int,
          *per_request: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len or not req_to_token.is_contiguous():
        raise ValueError(f"{op}: req_to_token must be a contiguous [rows, pool_len={pool_len}] table, "
                         f"got {list(req_to_token.shape)}")
    bs = req_pool_indices.numel()
    for t in per_request:
        if t.numel() < bs:
            raise ValueError(f"{op}: {t.numel()} per-request entries for a batch of {bs}")
    return [int(r) for r in req_pool_indices.view(-1).tolist()], req_to_token.view(-1)


def _spans(start_offset: torch.Tensor, end_offset: torch.Tensor, bs: int) -> list[tuple[int, int]]:
    starts = start_offset.view(-1)[:bs].tolist()
    ends = end_offset.view(-1)[:bs].tolist()
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[r_i, s_i:e_i] = out_cache_loc[o_i : o_i + e_i - s_i]``, with o_i the
    sum of the earlier requests' ``e - s``."""
    rows, table = _rows("assign_req_to_token_pool", req_pool_indices, req_to_token, pool_len,
                        start_offset, end_offset)
    src = out_cache_loc.view(-1)
    out = 0
    for r, (s, e) in zip(rows, _spans(start_offset, end_offset, len(rows))):
        n = max(e - s, 0)
        table[r * pool_len + s:r * pool_len + s + n] = src[out:out + n].to(table.dtype)
        out += e - s


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``out_cache_loc[o_i : o_i + e_i - s_i] = req_to_token[r_i, s_i:e_i]`` (o_i as above)."""
    rows, table = _rows("assign_extend_cache_locs", req_pool_indices, req_to_token, pool_len,
                        start_offset, end_offset)
    dst = out_cache_loc.view(-1)
    out = 0
    for r, (s, e) in zip(rows, _spans(start_offset, end_offset, len(rows))):
        n = max(e - s, 0)
        dst[out:out + n] = table[r * pool_len + s:r * pool_len + s + n].to(dst.dtype)
        out += e - s


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """``out_cache_loc[i*k : (i+1)*k] = req_to_token[r_i, seq_lens[i] : seq_lens[i] + k]``,
    k = ``topk * num_cols``."""
    rows, table = _rows("assign_draft_cache_locs_contiguous", req_pool_indices, req_to_token, pool_len,
                        seq_lens)
    k = int(topk) * int(num_cols)
    dst = out_cache_loc.view(-1)
    for i, (r, s) in enumerate(zip(rows, seq_lens.view(-1).tolist())):
        s = int(s)
        dst[i * k:(i + 1) * k] = table[r * pool_len + s:r * pool_len + s + k].to(dst.dtype)


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]``
    (``accept_lens`` counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.view(-1).tolist()):
        bonus_tokens[i] = flat[int(accept_stride) * i + int(n) - 1]


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """For every entry ``src > -1`` of ``accept_index`` (flattened), in order:
    ``accept_out_cache_loc[d] = out_cache_loc[src]``, d = how many entries before it
    are ``!= -1`` (the kernel's count)."""
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[int(src)]
        if src != -1:
            dst += 1
