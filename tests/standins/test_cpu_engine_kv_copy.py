"""KV cache copy of the CPU engine stand-in (harness.standins.cpu_engine.kv_copy) against
its definition (row ``tgt[i]`` of every buffer gets row ``src[i]``, all sources read
before any target is written), and inside SGLang's own ``MHATokenToKVPool``."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_engine import kv_copy

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _pool(shapes, dtype=torch.float32, rows=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bufs = [torch.randn((rows, *s), generator=gen).to(dtype) for s in shapes]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    return bufs, ptrs, strides


def _expected(bufs, tgt, src):
    out = [b.clone() for b in bufs]
    for b in out:
        b[tgt] = b[src].clone()
    return out


def test_copies_rows_of_every_buffer():
    bufs, ptrs, strides = _pool([(2, 4), (2, 4), (1, 3)])
    tgt, src = torch.tensor([3, 7]), torch.tensor([1, 2])
    want = _expected(bufs, tgt, src)
    kv_copy.copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


def test_reads_all_sources_before_writing():
    # a chain 0 <- 1 <- 2: row 1 must get the *old* row 2, row 0 the old row 1
    bufs, ptrs, strides = _pool([(4,)])
    old = bufs[0].clone()
    kv_copy.copy_all_layer_kv_cache(ptrs, strides, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert torch.equal(bufs[0][0], old[1]) and torch.equal(bufs[0][1], old[2])
    assert torch.equal(bufs[0][2:], old[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_strides(dtype):
    bufs, ptrs, strides = _pool([(2, 8), (2, 4), (1, 288)], dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    tgt = torch.randperm(16, generator=gen)[:6]
    src = torch.randint(0, 16, (6,), generator=gen)
    want = _expected(bufs, tgt, src)
    kv_copy.copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


def test_warm_up_with_identical_locations_changes_nothing():
    bufs, ptrs, strides = _pool([(2, 4)])
    old = bufs[0].clone()
    kv_copy.copy_all_layer_kv_cache(ptrs, strides, torch.zeros(256, dtype=torch.long), torch.zeros(256, dtype=torch.long))
    assert torch.equal(bufs[0], old)


def test_empty_is_a_no_op():
    bufs, ptrs, strides = _pool([(2, 4)])
    kv_copy.copy_all_layer_kv_cache(ptrs, strides, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))


def test_launcher_copies_the_first_num_locs():
    bufs, ptrs, strides = _pool([(2, 4)])
    tgt, src = torch.tensor([5, 6, 7, 0]), torch.tensor([1, 2, 3, 0])
    want = _expected(bufs, tgt[:2], src[:2])
    kv_copy.TiledCopyLauncher()[(1, 1)](ptrs, strides, tgt, src, 2, 4, BYTES_PER_TILE=128, num_warps=4, num_stages=2)
    assert torch.equal(bufs[0], want[0])


@pytest.mark.parametrize("tgt, src, message", [
    ([1, 2], [1], "target rows"),
    ([-1], [0], "negative"),
])
def test_refuses(tgt, src, message):
    bufs, ptrs, strides = _pool([(2, 4)])
    with pytest.raises(ValueError, match=message):
        kv_copy.copy_all_layer_kv_cache(ptrs, strides, torch.tensor(tgt), torch.tensor(src))


def test_sglang_pool_moves_kv_through_the_stand_in(monkeypatch):
    """SGLang's own ``MHATokenToKVPool`` (warm-up and ``move_kv_cache``), its copy kernel
    replaced where the CPU engine replaces it: the pin's Triton launch, or 0.5.23's
    ``copy_all_layer_kv_cache_cpu``."""
    mp = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    monkeypatch.delenv("SGLANG_NATIVE_MOVE_KV_CACHE", raising=False)
    if hasattr(mp, "copy_all_layer_kv_cache_tiled"):
        monkeypatch.setattr(mp, "copy_all_layer_kv_cache_tiled", kv_copy.TiledCopyLauncher())
    else:
        import sglang.kernels.ops.kvcache.cache_move as cache_move

        monkeypatch.setattr(cache_move, "_is_cpu", True)
        monkeypatch.setattr(cache_move, "copy_all_layer_kv_cache_cpu", kv_copy.copy_all_layer_kv_cache, raising=False)
    pool = mp.MHATokenToKVPool(32, 1, torch.float32, 2, 8, 3, "cpu", False, v_head_dim=4,
                               enable_alt_stream=False, enable_kv_cache_copy=True)
    assert pool._kv_copy_config is not None
    gen = torch.Generator().manual_seed(3)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    tgt, src = torch.tensor([4, 9, 10]), torch.tensor([9, 1, 2])
    want = _expected(pool.k_buffer + pool.v_buffer, tgt, src)
    pool.move_kv_cache(tgt, src)
    for b, w in zip(pool.k_buffer + pool.v_buffer, want):
        assert torch.equal(b, w)
