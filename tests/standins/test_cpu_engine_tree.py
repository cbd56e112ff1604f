"""EAGLE tree ops of the CPU engine stand-in (harness.standins.cpu_engine.tree) against
their definition: hand-checked trees, invariants on random trees built the way EAGLE
builds them, the host checks of sgl-kernel's ``tree.cuh``, and (0.5.23) SGLang's own
Triton versions of both kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_engine import tree

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

FULL, QLEN, PACKED = tree.FULL_MASK, tree.QLEN_ONLY, tree.QLEN_ONLY_BITPACKING


def _buffers(bs: int, n: int, seq_lens: list[int], mode: int):
    if mode == FULL:
        mask = torch.full((sum(seq_lens) * n + n * n * bs,), True)
    elif mode == QLEN:
        mask = torch.full((bs * n * n,), True)
    else:
        mask = torch.zeros((bs * n,), dtype=torch.uint8 if n <= 8 else torch.int16 if n <= 16 else torch.int32)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    return mask, positions, retrieve[0], retrieve[1], retrieve[2]


def _build(parent_list, selected, seq_lens, topk, depth, n, mode=FULL):
    bs = len(seq_lens)
    mask, pos, r_index, r_next, r_sib = _buffers(bs, n, seq_lens, mode)
    tree.build_tree_kernel_efficient(
        torch.tensor(parent_list, dtype=torch.long).view(bs, -1),
        torch.tensor(selected, dtype=torch.long).view(bs, -1),
        torch.tensor(seq_lens, dtype=torch.long), mask, pos, r_index, r_next, r_sib,
        topk, depth, n, mode)
    return mask, pos, r_index, r_next, r_sib


def _draft_rows(mask: torch.Tensor, mode: int, seq_lens: list[int], n: int) -> list[list[list[int]]]:
    """Per request, per token: its mask row over the n draft columns (0/1)."""
    rows, start = [], 0
    for b, s in enumerate(seq_lens):
        req = []
        for i in range(n):
            if mode == FULL:
                off = start + (s + n) * i + s
            else:
                off = n * n * b + n * i
            req.append([int(x) for x in mask[off:off + n].tolist()])
        rows.append(req)
        start += (s + n) * n
    return rows


def test_chain_topk1():
    # topk 1, depth 3: token i's parent is token i-1 (selected flat indices 0, 1, 2)
    mask, pos, r_index, r_next, r_sib = _build([-1, 0, 1], [0, 1, 2], [5], topk=1, depth=3, n=4)
    assert pos.tolist() == [5, 6, 7, 8]
    assert r_index.tolist() == [[0, 1, 2, 3]]
    assert r_next.tolist() == [[1, 2, 3, -1]]
    assert r_sib.tolist() == [[-1, -1, -1, -1]]
    assert _draft_rows(mask, FULL, [5], 4) == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]]
    # the context columns of FULL_MASK are the caller's (pre-filled True), untouched
    assert mask.view(4, 9)[:, :5].all()


def test_branching_topk2():
    # topk 2, depth 2: tokens 1, 2 are the root's children (flat 0, 1: 0 // 2 == 0);
    # token 3 (flat 2: 2 // 2 == 1 -> parent_list[1] == 0 -> the token at flat 0) is 1's child
    mask, pos, r_index, r_next, r_sib = _build([-1, 0, 1], [0, 1, 2], [3], topk=2, depth=2, n=4)
    assert pos.tolist() == [3, 4, 4, 5]
    assert r_next.tolist() == [[1, 3, -1, -1]]       # root -> 1, 1 -> 3
    assert r_sib.tolist() == [[-1, 2, -1, -1]]       # 1's next sibling is 2
    assert _draft_rows(mask, FULL, [3], 4) == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]


def test_batch_offsets_and_qlen_only():
    mask, pos, r_index, r_next, r_sib = _build([-1, 0, 1, -1, 0, 1], [0, 1, 2, 0, 1, 2], [2, 7],
                                               topk=1, depth=3, n=4, mode=QLEN)
    assert pos.tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    assert r_index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # global (b * n + i)
    rows = _draft_rows(mask, QLEN, [2, 7], 4)
    assert rows[0] == rows[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_bitpacked_rows():
    mask, *_ = _build([-1, 0, 1], [0, 1, 2], [3], topk=2, depth=2, n=4, mode=PACKED)
    # bit j of row i: token j is i or an ancestor of i (bit 0: the root)
    assert mask.tolist() == [0b0001, 0b0011, 0b0101, 0b1011]


def test_bitpacked_two_bytes_per_row():
    n = 10
    seq = list(range(n - 1))  # chain: flat indices 0..8 with topk 1
    mask, *_ = _build([-1] + list(range(n - 2)), seq, [1], topk=1, depth=n - 1, n=n, mode=PACKED)
    assert mask.dtype == torch.int16
    assert mask.tolist()[n - 1] == (1 << n) - 1  # the deepest token sees all ten
    assert mask.view(torch.uint8).tolist()[2 * (n - 1):2 * n] == [0xFF, 0x03]


def test_invalid_tree_skips_the_token_with_a_warning(capfd):
    # token 2 (flat 3: 3 // 1 == 3 -> parent_list[3] == 7) names a parent never selected
    mask, pos, r_index, r_next, r_sib = _build([-1, 0, 1, 7], [0, 3], [4], topk=1, depth=4, n=3)
    assert "invalid eagle tree" in capfd.readouterr().err
    assert r_next.tolist() == [[1, -1, -1]]    # only token 1 is linked
    assert pos.tolist()[:2] == [4, 5]


@pytest.mark.parametrize("bad, message", [
    (dict(topk=0), "topk and depth"),
    (dict(n=0), "draft_token_num"),
    (dict(mode=3), "tree_mask_mode"),
    (dict(parent_dtype=torch.int32), "parent_list"),
    (dict(width=4), "parent_list width"),
    (dict(selected_shape=(1, 2)), "selected_index"),
    (dict(positions=5), "positions"),
])
def test_host_checks(bad, message):
    n, topk, depth = 4, bad.get("topk", 1), 3
    n = bad.get("n", n)
    parent = torch.tensor([[-1, 0, 1] + [0] * (bad.get("width", 3) - 3)], dtype=bad.get("parent_dtype", torch.long))
    selected = torch.zeros(bad.get("selected_shape", (1, max(n - 1, 0))), dtype=torch.long)
    mask, pos, r_index, r_next, r_sib = _buffers(1, max(n, 1), [2], FULL)
    if "positions" in bad:
        pos = torch.empty(bad["positions"], dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        tree.build_tree_kernel_efficient(parent, selected, torch.tensor([2]), mask, pos, r_index[:, :max(n, 1)],
                                         r_next[:, :max(n, 1)], r_sib[:, :max(n, 1)], topk, depth, n,
                                         bad.get("mode", FULL))


# ---- random trees, built the way EAGLE's draft stage builds them --------------------

def random_tree(bs: int, topk: int, depth: int, n: int, gen: torch.Generator):
    """(parent_list, selected_index, scores): EAGLE's encoding (``select_top_k_tokens`` +
    ``organize_draft_results``). Flat index f: step 0 tokens at [0, topk); step i >= 1
    expands each of the topk beams into topk children at topk + (i-1)topk^2 + beam*topk + c.
    parent_list = [-1, step-0 tokens, the beams kept at steps 1..depth-2]."""
    parents, scores_all = [], []
    for _ in range(bs):
        p0 = torch.rand(topk, generator=gen).sort(descending=True).values
        scores = [p0]
        beams = list(range(topk))          # flat index of each beam's token
        beam_scores = p0.clone()
        plist = [-1] + beams[:]
        for i in range(1, depth):
            probs = torch.rand(topk, topk, generator=gen)
            expand = beam_scores.view(topk, 1) * probs
            scores.append(expand.flatten())
            keep = torch.topk(expand.flatten(), topk).indices
            base = topk + (i - 1) * topk * topk
            beams = [base + int(k) for k in keep]
            beam_scores = expand.flatten()[keep]
            if i < depth - 1:
                plist += beams
        flat = torch.cat(scores)
        parents.append(plist[: topk * (depth - 1) + 1])
        scores_all.append(flat)
    flat_scores = torch.stack(scores_all)
    selected = torch.sort(torch.topk(flat_scores, n - 1, dim=-1).indices).values
    return torch.tensor(parents, dtype=torch.long), selected, flat_scores


def _parent_token(parent_list, selected, topk, b, i):
    tb = int(selected[b, i - 1]) // topk
    if tb == 0:
        return 0
    target = int(parent_list[b, tb])
    return selected[b].tolist().index(target) + 1


@pytest.mark.parametrize("topk, depth, n", [(1, 3, 4), (2, 3, 4), (2, 4, 6), (4, 3, 8), (3, 5, 12)])
def test_random_trees_satisfy_the_definition(topk, depth, n):
    gen = torch.Generator().manual_seed(topk * 100 + depth * 10 + n)
    bs, seq_lens = 3, [3, 0, 6]
    parent_list, selected, _ = random_tree(bs, topk, depth, n, gen)
    for mode in (FULL, QLEN):
        mask, pos, r_index, r_next, r_sib = _build(parent_list.flatten().tolist(), selected.flatten().tolist(),
                                                   seq_lens, topk, depth, n, mode)
        rows = _draft_rows(mask, mode, seq_lens, n)
        for b in range(bs):
            parent = {i: _parent_token(parent_list, selected, topk, b, i) for i in range(1, n)}

            def ancestors(i):
                out = {i}
                while i:
                    i = parent[i]
                    out.add(i)
                return out

            for i in range(n):
                anc = ancestors(i)
                assert rows[b][i] == [1 if j in anc else 0 for j in range(n)]
                assert pos[b * n + i] == seq_lens[b] + len(anc) - 1
                assert r_index[b, i] == b * n + i
            # children lists from (next, sibling) == children by parent, increasing
            for p in range(n):
                kids, c = [], int(r_next[b, p])
                while c != -1:
                    kids.append(c)
                    c = int(r_sib[b, c])
                assert kids == sorted(i for i in range(1, n) if parent[i] == p)


# ---- verify_tree_greedy -------------------------------------------------------------

def _verify(candidates, r_index, r_next, r_sib, target, spec):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, spec), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    tree.verify_tree_greedy(predicts, accept_index, accept_num, candidates, r_index, r_next, r_sib, target)
    return predicts, accept_index, accept_num


def test_verify_chain_by_hand():
    # chain root -> 1 -> 2 -> 3; draft tokens [_, 10, 11, 12]; target predicts 10, 11, 99 at 0, 1, 2
    cand = torch.tensor([[5, 10, 11, 12]])
    r_index = torch.tensor([[0, 1, 2, 3]])
    r_next = torch.tensor([[1, 2, 3, -1]])
    r_sib = torch.full((1, 4), -1)
    target = torch.tensor([[10, 11, 99, 42]])
    predicts, accept_index, accept_num = _verify(cand, r_index, r_next, r_sib, target, spec=4)
    assert accept_num.tolist() == [2]
    assert accept_index.tolist() == [[0, 1, 2, -1]]
    assert predicts.tolist() == [10, 11, 99, -7]  # accepted tokens, then the bonus at the last one


def test_verify_takes_the_matching_sibling():
    # root's children 1 (token 20) and 2 (token 21); 2 -> 3 (token 30); target: 21 then 30 then 77
    cand = torch.tensor([[5, 20, 21, 30]])
    r_index = torch.tensor([[0, 1, 2, 3]])
    r_next = torch.tensor([[1, -1, 3, -1]])
    r_sib = torch.tensor([[-1, 2, -1, -1]])
    target = torch.tensor([[21, 0, 30, 77]])
    predicts, accept_index, accept_num = _verify(cand, r_index, r_next, r_sib, target, spec=3)
    assert accept_num.tolist() == [2]
    assert accept_index.tolist() == [[0, 2, 3]]
    assert predicts.tolist() == [21, -7, 30, 77]


def test_verify_batch_uses_global_retrieve_indices():
    cand = torch.tensor([[5, 10, 11], [6, 13, 14]])
    r_index = torch.tensor([[0, 1, 2], [3, 4, 5]])
    r_next = torch.tensor([[1, 2, -1], [1, 2, -1]])
    r_sib = torch.full((2, 3), -1)
    target = torch.tensor([[10, 11, 12], [99, 14, 15]])
    predicts, accept_index, accept_num = _verify(cand, r_index, r_next, r_sib, target, spec=3)
    assert accept_num.tolist() == [2, 0]
    assert accept_index.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert predicts.tolist() == [10, 11, 12, 99, -7, -7]


@pytest.mark.parametrize("name, tensor", [
    ("accept_index", torch.zeros(1, 3, dtype=torch.int64)),
    ("predicts", torch.zeros(2, dtype=torch.int32)),
    ("target_predict", torch.zeros(1, 3, dtype=torch.int32)),
])
def test_verify_host_checks(name, tensor):
    args = dict(predicts=torch.zeros(3, dtype=torch.int32), accept_index=torch.zeros(1, 3, dtype=torch.int32),
                accept_token_num=torch.zeros(1, dtype=torch.int32), candidates=torch.zeros(1, 3, dtype=torch.long),
                retrive_index=torch.zeros(1, 3, dtype=torch.long), retrive_next_token=torch.zeros(1, 3, dtype=torch.long),
                retrive_next_sibling=torch.zeros(1, 3, dtype=torch.long), target_predict=torch.zeros(1, 3, dtype=torch.long))
    args[name] = tensor
    with pytest.raises(ValueError, match=name):
        tree.verify_tree_greedy(**args)


def _walk(cand, r_next, r_sib, target, spec, b, n):
    """Greedy acceptance from the definition: follow the first child matching the target."""
    node, path = 0, [0]
    for _ in range(spec - 1):
        c = int(r_next[b, node])
        while c != -1 and int(cand[b, c]) != int(target.view(-1)[b * n + node]):
            c = int(r_sib[b, c])
        if c == -1:
            break
        node = c
        path.append(c)
    return path


@pytest.mark.parametrize("topk, depth, n", [(1, 3, 4), (2, 3, 4), (4, 4, 8)])
def test_verify_random_trees_follow_the_target(topk, depth, n):
    gen = torch.Generator().manual_seed(7 + n)
    bs = 4
    parent_list, selected, _ = random_tree(bs, topk, depth, n, gen)
    mask, pos, r_index, r_next, r_sib = _build(parent_list.flatten().tolist(), selected.flatten().tolist(),
                                               [4] * bs, topk, depth, n)
    cand = torch.randint(0, 3, (bs, n), generator=gen)   # few token values: many matches and misses
    target = torch.randint(0, 3, (bs, n), generator=gen)
    spec = depth + 1
    predicts, accept_index, accept_num = _verify(cand, r_index, r_next, r_sib, target, spec)
    for b in range(bs):
        path = _walk(cand, r_next, r_sib, target, spec, b, n)
        assert accept_num[b] == len(path) - 1
        assert accept_index[b, :len(path)].tolist() == [b * n + i for i in path]
        for prev, nxt in zip(path, path[1:]):
            assert predicts[b * n + prev] == cand[b, nxt]
        assert predicts[b * n + path[-1]] == target[b, path[-1]]


# ---- SGLang 0.5.23's Triton versions (the XPU path), run by Triton's interpreter ----

@pytest.fixture(scope="module")
def spec_tree_interpreted():
    pytest.importorskip("triton")
    st = pytest.importorskip("sglang.kernels.ops.speculative.spec_tree")
    from triton.runtime.interpreter import InterpretedFunction

    saved = st.sgl_build_tree_kernel_efficient_triton, st.verify_tree_greedy_kernel_triton
    st.sgl_build_tree_kernel_efficient_triton = InterpretedFunction(saved[0].fn)
    st.verify_tree_greedy_kernel_triton = InterpretedFunction(saved[1].fn)
    yield st
    st.sgl_build_tree_kernel_efficient_triton, st.verify_tree_greedy_kernel_triton = saved


@pytest.mark.bases("0.5.23")
@pytest.mark.parametrize("topk, depth, n", [(1, 3, 4), (2, 3, 4), (2, 4, 6), (4, 3, 8)])
@pytest.mark.parametrize("mode", [FULL, QLEN])
def test_matches_sglang_triton_build_tree(spec_tree_interpreted, topk, depth, n, mode):
    st = spec_tree_interpreted
    gen = torch.Generator().manual_seed(topk + depth + n)
    seq_lens = [3, 1, 5]
    parent_list, selected, _ = random_tree(3, topk, depth, n, gen)
    mine = _build(parent_list.flatten().tolist(), selected.flatten().tolist(), seq_lens, topk, depth, n, mode)
    ref = _buffers(3, n, seq_lens, mode)
    st.sgl_build_tree_kernel_triton(parent_list, selected, torch.tensor(seq_lens), *ref, topk, depth, n,
                                    st.TreeMaskMode(mode))
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)


@pytest.mark.bases("0.5.23")
@pytest.mark.parametrize("topk, depth, n", [(1, 3, 4), (2, 3, 4), (4, 4, 8)])
def test_matches_sglang_triton_verify(spec_tree_interpreted, topk, depth, n):
    st = spec_tree_interpreted
    gen = torch.Generator().manual_seed(31 * n + topk)
    bs, spec = 3, depth + 1
    parent_list, selected, _ = random_tree(bs, topk, depth, n, gen)
    _, _, r_index, r_next, r_sib = _build(parent_list.flatten().tolist(), selected.flatten().tolist(),
                                          [2] * bs, topk, depth, n)
    cand = torch.randint(0, 3, (bs, n), generator=gen)
    target = torch.randint(0, 3, (bs, n), generator=gen)
    mine = _verify(cand, r_index, r_next, r_sib, target, spec)
    ref = (torch.full((bs * n,), -7, dtype=torch.int32), torch.full((bs, spec), -1, dtype=torch.int32),
           torch.zeros(bs, dtype=torch.int32))
    st.verify_tree_greedy_triton(*ref, cand, r_index, r_next, r_sib, target)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
