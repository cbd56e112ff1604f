"""Exact-byte checks of the live-storage tracker (CPU) and the CUDA peak tracker (GPU)."""

from __future__ import annotations

import pytest
import torch

from harness.memory.tracker import CudaPeakTracker, LiveStorageTracker, make_tracker, untracked

T, H, K = 12, 32, 4
F32 = 4


def test_allocation_counts_exact_bytes():
    with LiveStorageTracker("cpu") as t:
        a = torch.empty(T, H)
        assert t.current_bytes == T * H * F32
        b = torch.zeros(T, H, dtype=torch.bfloat16)
        assert t.current_bytes == T * H * (F32 + 2)
        assert t.peak_bytes == t.current_bytes
        del a, b
        assert t.current_bytes == 0
    assert t.peak_bytes == T * H * 6 and t.n_allocs == 2


def test_cat_of_k_peaks_at_twice_the_inputs():
    with LiveStorageTracker() as t:
        xs = [torch.randn(T, H) for _ in range(K)]
        inputs = K * T * H * F32
        assert t.current_bytes == inputs
        out = torch.cat(xs, dim=-1)
        assert t.peak_bytes == 2 * inputs
        del xs
        assert t.current_bytes == inputs
        del out
        assert t.current_bytes == 0


def test_packer_style_copy_into_preallocated_buffer_allocates_nothing_more():
    with LiveStorageTracker() as t:
        buf = torch.empty(T, K * H)
        assert t.current_bytes == K * T * H * F32
        t.reset_peak()
        for k in range(K):
            x = torch.randn(T, H)  # one capture at a time
            buf[:, k * H:(k + 1) * H].copy_(x)
            del x
        # peak = buffer + one capture; the copies themselves allocate nothing
        assert t.peak_bytes == K * T * H * F32 + T * H * F32
        assert t.current_bytes == K * T * H * F32


def test_untracked_allocations_are_invisible():
    """A stand-in's own compute (``untracked``) does not count; what it hands back is
    the caller's, and writing into a tracked buffer stays free."""
    with LiveStorageTracker() as t:
        out = torch.empty(T, K * H)
        with untracked():
            scratch = torch.randn(T, H)
            out[:, :H].copy_(scratch)
        del scratch
        assert t.current_bytes == t.peak_bytes == T * K * H * F32 and t.n_allocs == 1


def test_views_and_inplace_allocate_nothing():
    x = torch.randn(T, H)  # baseline: alive at entry, excluded
    with LiveStorageTracker() as t:
        v = x[1:].view(-1)
        w = x.t()
        x.add_(1.0)
        x.mul_(2.0)
        torch.add(x, 1.0, out=x)
        y = x.new_empty(T, H)
        assert t.current_bytes == T * H * F32  # only the new_empty
        y.copy_(x)
        y.zero_()
        assert t.current_bytes == T * H * F32
        assert t.peak_bytes == T * H * F32
        del v, w
        assert t.current_bytes == T * H * F32


def test_view_keeps_storage_alive_and_counted_once():
    with LiveStorageTracker() as t:
        a = torch.empty(T, H)
        v1, v2 = a[0], a.view(H, T)
        del a
        assert t.current_bytes == T * H * F32 and t.live_storages == 1
        del v1
        assert t.current_bytes == T * H * F32
        del v2
        assert t.current_bytes == 0


def test_baseline_excluded_and_freed_drops_current():
    keep = [torch.randn(T, H) for _ in range(3)]
    with LiveStorageTracker() as t:
        s = keep[0] + keep[1]  # new result: counted
        assert t.current_bytes == T * H * F32
        del keep[2]  # a baseline storage dying changes nothing
        assert t.current_bytes == T * H * F32
        del s
        assert t.current_bytes == 0
        assert t.peak_bytes == T * H * F32


def test_reset_peak_and_resize_out():
    with LiveStorageTracker() as t:
        a = torch.empty(T, H)
        tmp = torch.empty(T, H)
        del tmp
        assert t.peak_bytes == 2 * T * H * F32
        t.reset_peak()
        assert t.peak_bytes == T * H * F32
        out = torch.empty(0)
        torch.cat([a, a], out=out)  # out= grows a tracked storage
        assert t.current_bytes == 3 * T * H * F32
        del a, out
        assert t.current_bytes == 0


def test_other_device_filtered_out():
    with LiveStorageTracker("cuda") as t:
        x = torch.empty(T, H)  # cpu: not tracked by a cuda tracker
        assert t.current_bytes == 0
    del x


def test_make_tracker_cpu():
    t = make_tracker("cpu")
    assert isinstance(t, LiveStorageTracker)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_tracker_cat():
    dev = "cuda"
    with CudaPeakTracker(dev, warmup=lambda: torch.cat([torch.ones(1, device=dev)] * 2)) as t:
        xs = [torch.randn(T * 64, H * 64, device=dev) for _ in range(K)]
        inputs = K * T * 64 * H * 64 * F32
        out = torch.cat(xs, dim=-1)
        assert t.peak_bytes == 2 * inputs  # sizes are multiples of 512 B: no rounding
        del xs
        assert t.current_bytes == inputs
        del out
        assert t.current_bytes == 0
    with LiveStorageTracker(dev) as exact:
        xs = [torch.randn(T, H, device=dev) for _ in range(K)]
        torch.cat(xs, dim=-1)
    assert exact.peak_bytes == 2 * K * T * H * F32
