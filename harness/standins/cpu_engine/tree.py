"""EAGLE tree ops on the CPU: ``build_tree_kernel_efficient`` and ``verify_tree_greedy``.

The definition is sgl-kernel's CUDA kernels (``build_tree_efficient``,
``build_tree_efficient_partial_packed`` and ``VerifyTreeGreedy`` in SGLang 0.5.23's
``kernels/jit/include/sgl_kernel/speculative/eagle.cuh``, host checks in
``kernels/jit/csrc/speculative/tree.cuh``); SGLang 0.5.23 also carries a Triton
version of both for XPU (``kernels/ops/speculative/spec_tree.py``), which the unit
tests run under Triton's interpreter as a second reference. Written from those
semantics, one request (CUDA block) at a time, with plain Python over ``tolist()``:
the engine's trees are a handful of tokens.

Where the kernels disagree only on an invalid tree (a draft token whose parent was not
selected: the CUDA kernel prints a warning and skips the token's link, then walks off
its row building the mask), this version skips the link with the same warning and
stops the mask walk there, as the Triton version does.

The host-side checks of ``tree.cuh`` are kept: wrong dtypes, shapes or modes raise
``ValueError`` naming the op, as the real op refuses them.
"""

from __future__ import annotations

import sys

import torch

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2
_INVALID_TREE = (
    "WARNING: invalid eagle tree!!! Detected a token with no parent token selected. "
    "Please check if the logprob has nan. The token will be ignored to keep proceeding."
)


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{op}: {what}")


def _check_tensor(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _check(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
    _check(tuple(t.shape) == shape, op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _check(t.is_contiguous(), op, f"{name} must be contiguous")


def _parent_slot(sel: list[int], token: int, n: int) -> int:
    """Index in ``selected_index`` (a row of n - 1) holding ``token``; -1 if none."""
    for p in range(n - 1):
        if sel[p] == token:
            return p
    return -1


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Fill the tree mask, positions and retrieve links of a draft tree, in place.

    For request b with n = ``draft_token_num`` tokens (token 0 is the verified one,
    token i > 0 is ``selected_index[b, i - 1]``): token i's parent is the token whose
    selected index equals ``parent_list[b, selected_index[b, i - 1] // topk]`` (token 0
    when that quotient is 0). Outputs: ``positions[b*n + i]`` = seq_len + depth of i;
    ``retrive_index[b, i]`` = b*n + i; ``retrive_next_token[b, p]`` = first child of p,
    ``retrive_next_sibling[b, i]`` = the next sibling of i (children in increasing
    order); both are expected pre-filled with -1. Mask row i holds True for i's
    ancestors and itself among the n draft columns (column 0 always), False for the
    others; in FULL_MASK rows are seq_len + n wide and their first seq_len entries are
    left as the caller filled them; QLEN_ONLY rows are n wide; QLEN_ONLY_BITPACKING
    rows are 1, 2 or 4 little-endian bytes, OR-ed in (the caller zero-fills).
    """
    op = "build_tree_kernel_efficient"
    mode = int(tree_mask_mode)
    n = int(draft_token_num)
    _check(topk > 0 and depth > 0, op, f"topk and depth must be > 0, got {topk}, {depth}")
    _check(0 < n <= 1024, op, f"draft_token_num must be in 1..1024, got {n}")
    _check(mode in (FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING), op, f"tree_mask_mode {mode} is not 0, 1 or 2")
    _check(parent_list.dim() == 2 and parent_list.dtype == torch.int64, op,
           f"parent_list must be an int64 [bs, width] tensor, got {parent_list.dtype} {list(parent_list.shape)}")
    bs = parent_list.shape[0]
    _check(depth == 1 or parent_list.shape[1] == topk * (depth - 1) + 1, op,
           f"parent_list width {parent_list.shape[1]} != topk * (depth - 1) + 1 = {topk * (depth - 1) + 1}")
    _check_tensor(op, "selected_index", selected_index, (bs, n - 1), torch.int64)
    _check_tensor(op, "verified_seq_len", verified_seq_len, (bs,), torch.int64)
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _check_tensor(op, name, t, (bs, n), torch.int64)
    _check_tensor(op, "positions", positions, (bs * n,), torch.int64)
    _check(tree_mask.dim() == 1 and tree_mask.is_contiguous(), op, "tree_mask must be a contiguous 1-D tensor")
    item = tree_mask.element_size()
    width = 4 if n > 16 else 2 if n > 8 else 1  # bytes per packed row
    if mode == QLEN_ONLY_BITPACKING:
        _check(n <= 32, op, f"QLEN_ONLY_BITPACKING takes at most 32 draft tokens, got {n}")
        need = bs * n * width
    elif mode == QLEN_ONLY:
        need = bs * n * n
    else:
        need = 0
    _check(tree_mask.numel() * item >= need, op, f"tree_mask holds {tree_mask.numel() * item} bytes, needs {need}")
    if bs == 0:
        return
    # The kernels see the mask as raw bytes (bool/uint8, or packed uint8/16/32).
    mask = tree_mask.view(torch.uint8)
    parents = parent_list.tolist()
    selected = selected_index.tolist()
    seq_lens = verified_seq_len.tolist()
    pos = positions.view(bs, n)
    r_index, r_next, r_sibling = retrive_index, retrive_next_token, retrive_next_sibling
    mask_start = 0  # FULL_MASK: where request b's rows begin
    for b in range(bs):
        seq_len = int(seq_lens[b])
        sel = selected[b]

        def parent_of(slot: int) -> int:
            """Slot (in selected_index) of the parent of the token at ``slot``; -1: the
            root (token 0); -2: no parent selected (an invalid tree)."""
            tb = sel[slot] // topk
            if tb == 0:
                return -1
            found = _parent_slot(sel, parents[b][tb], n)
            return found if found >= 0 else -2

        # Thread 0: retrieve links, last token first, so children end up in order.
        sib = r_sibling[b].tolist()
        nxt = r_next[b].tolist()
        for i in range(n - 1, 0, -1):
            r_index[b, i] = b * n + i
            p = parent_of(i - 1)
            if p == -2:
                print(_INVALID_TREE, file=sys.stderr, flush=True)
                continue
            parent_position = p + 1  # token index of the parent (0: the root)
            if nxt[parent_position] != -1:
                sib[i] = nxt[parent_position]
            nxt[parent_position] = i
        r_index[b, 0] = b * n
        r_next[b] = torch.tensor(nxt, dtype=torch.int64)
        r_sibling[b] = torch.tensor(sib, dtype=torch.int64)

        # Threads 0..n-1: one mask row each, and the token's position.
        for tid in range(n):
            if mode == QLEN_ONLY_BITPACKING:
                row = (b * n + tid) * width
                mask[row] = 1
            else:
                if mode == FULL_MASK:
                    row = mask_start + (seq_len + n) * tid + seq_len  # column of token 0
                else:
                    row = n * n * b + n * tid
                mask[row] = 1
                mask[row + 1:row + n] = 0
            if tid == 0:
                pos[b, 0] = seq_len
                continue
            slot = tid - 1
            depth_of = 0
            while True:
                depth_of += 1
                if mode == QLEN_ONLY_BITPACKING:
                    byte, bit = divmod(slot + 1, 8)
                    mask[row + byte] |= 1 << bit
                else:
                    mask[row + 1 + slot] = 1
                p = parent_of(slot)
                if p < 0:
                    break
                slot = p
            pos[b, tid] = seq_len + depth_of
        mask_start += (seq_len + n) * n


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Walk each request's draft tree along the target's greedy tokens, in place.

    From the root, at each of ``accept_index.shape[1] - 1`` levels, the first child
    (then its siblings) whose candidate token equals the target's prediction at the
    last accepted node is accepted: ``predicts[last] = that token``, its retrieve index
    appended to ``accept_index[b]``. The walk stops at the first level with no match.
    ``accept_token_num[b]`` = tokens accepted (the root not counted);
    ``predicts[last]`` = the target's token there (the bonus token). Entries of
    ``accept_index`` past the accepted ones and of ``predicts`` off the path are left
    as they were (the caller pre-fills them).
    """
    op = "verify_tree_greedy"
    _check(candidates.dim() == 2, op, f"candidates must be [bs, draft_tokens], got {list(candidates.shape)}")
    bs, n = candidates.shape
    for name, t in (("candidates", candidates), ("retrive_index", retrive_index),
                    ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling), ("target_predict", target_predict)):
        _check_tensor(op, name, t, (bs, n), torch.int64)
    _check(accept_index.dim() == 2 and accept_index.shape[0] == bs, op,
           f"accept_index must be [bs={bs}, spec_tokens], got {list(accept_index.shape)}")
    spec = accept_index.shape[1]
    _check_tensor(op, "accept_index", accept_index, (bs, spec), torch.int32)
    _check_tensor(op, "accept_token_num", accept_token_num, (bs,), torch.int32)
    _check_tensor(op, "predicts", predicts, (bs * n,), torch.int32)
    _check(n > 0 and spec > 0, op, f"draft_tokens and spec_tokens must be > 0, got {n}, {spec}")
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sibling = retrive_next_sibling.tolist()
    target = target_predict.view(-1).tolist()
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, spec):
            cur = r_next[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    predicts[last] = target[last]
                    accepted += 1
                    accept_index[b, accepted] = r_index[b][cur]
                    last = r_index[b][cur]
                    break
                cur = r_sibling[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = target[last]
