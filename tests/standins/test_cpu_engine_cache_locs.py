"""KV cache-location ops of the CPU engine stand-in (harness.standins.cpu_engine.cache_locs)
against their definition: hand-checked cases, and SGLang's own Triton kernels of the
active base (the ones the ``*_cpu`` ops replace) run under Triton's interpreter on
random inputs."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.standins.cpu_engine import cache_locs

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

# kernel -> where each base defines it (0.5.23 first, then the pin)
_KERNELS = {
    "assign_req_to_token_pool": ("sglang.srt.mem_cache.allocation", "sglang.srt.speculative.triton_ops.cache_locs"),
    "assign_extend_cache_locs": ("sglang.kernels.ops.speculative.cache_locs",
                                 "sglang.srt.speculative.triton_ops.cache_locs"),
    "assign_draft_cache_locs_contiguous": ("sglang.kernels.ops.speculative.cache_locs",
                                           "sglang.srt.speculative.triton_ops.cache_locs"),
    "fill_bonus_tokens": ("sglang.kernels.ops.speculative.eagle", "sglang.srt.speculative.triton_ops.eagle"),
    "fill_accept_out_cache_loc": ("sglang.kernels.ops.speculative.eagle", "sglang.srt.speculative.triton_ops.eagle"),
}


@pytest.fixture
def sglang_kernel(interpreted):
    """``sglang_kernel(name)``: SGLang's Triton kernel ``name`` of the active base, interpreted."""
    return lambda name: _find(name, interpreted)


def _find(name: str, interpreted):
    for module_name in _KERNELS[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return interpreted(getattr(module, name))
    pytest.fail(f"no Triton kernel {name} in this SGLang ({', '.join(_KERNELS[name])})")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _table(rows: int = 6, pool_len: int = 40, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(rows * pool_len, generator=gen).view(rows, pool_len).to(torch.int32)


def test_assign_req_to_token_pool_by_hand():
    table = torch.zeros(3, 8, dtype=torch.int32)
    cache_locs.assign_req_to_token_pool(torch.tensor([2, 0]), table, torch.tensor([1, 4]), torch.tensor([3, 7]),
                                        torch.tensor([10, 11, 20, 21, 22]), 8)
    assert table.tolist() == [[0, 0, 0, 0, 20, 21, 22, 0], [0] * 8, [0, 10, 11, 0, 0, 0, 0, 0]]


def test_assign_extend_cache_locs_by_hand():
    table = torch.arange(24, dtype=torch.int32).view(3, 8)
    out = torch.full((5,), -1, dtype=torch.int64)
    cache_locs.assign_extend_cache_locs(torch.tensor([2, 0]), table, torch.tensor([1, 4]), torch.tensor([3, 7]), out, 8)
    assert out.tolist() == [17, 18, 4, 5, 6]


def test_assign_draft_cache_locs_contiguous_by_hand():
    table = torch.arange(24, dtype=torch.int32).view(3, 8)
    out = torch.full((8,), -1, dtype=torch.int64)
    cache_locs.assign_draft_cache_locs_contiguous(torch.tensor([1, 2]), table, torch.tensor([2, 4]), out, 8, 2, 2)
    assert out.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]


def test_fill_bonus_tokens_by_hand():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    bonus = torch.zeros(2, dtype=torch.int64)
    cache_locs.fill_bonus_tokens(tokens, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [7, 9]


def test_fill_accept_out_cache_loc_by_hand():
    out = torch.zeros(4, dtype=torch.int64)
    cache_locs.fill_accept_out_cache_loc(torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.tensor([50, 51, 52, 53]), out)
    assert out.tolist() == [50, 52, 53, 0]


def test_pool_len_must_match_the_table():
    with pytest.raises(ValueError, match="pool_len"):
        cache_locs.assign_extend_cache_locs(torch.tensor([0]), torch.zeros(2, 8, dtype=torch.int32),
                                            torch.tensor([0]), torch.tensor([1]), torch.zeros(1), 7)


def test_short_offsets_are_refused():
    with pytest.raises(ValueError, match="batch of 2"):
        cache_locs.assign_req_to_token_pool(torch.tensor([0, 1]), torch.zeros(2, 8, dtype=torch.int32),
                                            torch.tensor([0]), torch.tensor([1]), torch.zeros(1), 8)


@pytest.fixture(params=[1, 2, 5], ids=lambda bs: f"bs{bs}")
def batch(request):
    bs = request.param
    gen = torch.Generator().manual_seed(bs)
    rows = torch.randperm(6, generator=gen)[:bs]
    start = torch.randint(0, 20, (bs,), generator=gen)
    end = start + torch.randint(0, 15, (bs,), generator=gen)
    return rows, start, end


def test_assign_req_to_token_pool_matches_sglang(batch, sglang_kernel):
    rows, start, end = batch
    kernel = sglang_kernel("assign_req_to_token_pool")
    locs = torch.randint(0, 10_000, (int((end - start).sum()),))
    mine, ref = _table(seed=1), _table(seed=1)
    cache_locs.assign_req_to_token_pool(rows, mine, start, end, locs, 40)
    kernel[(rows.numel(),)](rows, ref, start, end, locs, 40, _next_pow2(rows.numel()))
    assert torch.equal(mine, ref)


def test_assign_extend_cache_locs_matches_sglang(batch, sglang_kernel):
    rows, start, end = batch
    kernel = sglang_kernel("assign_extend_cache_locs")
    table = _table(seed=2)
    n = int((end - start).sum())
    mine, ref = torch.full((n + 3,), -1, dtype=torch.int64), torch.full((n + 3,), -1, dtype=torch.int64)
    cache_locs.assign_extend_cache_locs(rows, table, start, end, mine, 40)
    kernel[(rows.numel(),)](rows, table, start, end, ref, 40, _next_pow2(rows.numel()))
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("topk, cols", [(1, 3), (2, 2), (4, 3)])
def test_assign_draft_cache_locs_contiguous_matches_sglang(batch, topk, cols, sglang_kernel):
    rows, start, _ = batch
    kernel = sglang_kernel("assign_draft_cache_locs_contiguous")
    table = _table(seed=3)
    n = rows.numel() * topk * cols
    mine, ref = torch.full((n,), -1, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64)
    cache_locs.assign_draft_cache_locs_contiguous(rows, table, start, mine, 40, topk, cols)
    kernel[(rows.numel(),)](rows, table, start, ref, 40, topk, cols)
    assert torch.equal(mine, ref)


def test_fill_bonus_tokens_matches_sglang(sglang_kernel):
    gen = torch.Generator().manual_seed(4)
    bs, stride = 5, 4
    tokens = torch.randint(0, 1000, (bs, stride), generator=gen)
    lens = torch.randint(1, stride + 1, (bs,), generator=gen).to(torch.int32)
    mine, ref = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    cache_locs.fill_bonus_tokens(tokens, lens, mine, stride)
    sglang_kernel("fill_bonus_tokens")[(bs,)](tokens, lens, ref, stride)
    assert torch.equal(mine, ref)


def test_fill_accept_out_cache_loc_matches_sglang(sglang_kernel):
    gen = torch.Generator().manual_seed(5)
    bs, spec = 4, 4
    accepted = torch.randint(1, spec + 1, (bs,), generator=gen)
    index = torch.full((bs, spec), -1, dtype=torch.int32)
    for b in range(bs):
        index[b, :accepted[b]] = torch.randperm(bs * spec, generator=gen)[:accepted[b]].to(torch.int32)
    locs = torch.randint(0, 10_000, (bs * spec,), generator=gen)
    mine, ref = torch.zeros(bs * spec, dtype=torch.int64), torch.zeros(bs * spec, dtype=torch.int64)
    cache_locs.fill_accept_out_cache_loc(index, locs, mine)
    size = index.numel()
    sglang_kernel("fill_accept_out_cache_loc")[(size,)](index, locs, ref, _next_pow2(size))
    assert torch.equal(mine, ref)
