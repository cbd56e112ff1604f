"""MiniMax-M2's q/k RMSNorm kernels on the CPU (harness.standins.cpu_kernels.minimax_qknorm)
against their definition: per-row sums of squares (padded for the all-reduce), and the
norm over the full width of every rank's shards; fresh outputs, inputs untouched."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_kernels import minimax_qknorm as ops

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _naive_sumsq(x):
    return [sum(float(v) ** 2 for v in row) for row in x.tolist()]


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_sumsq_rows_then_padding(rows):
    g = _gen(rows)
    x1, x2 = torch.randn(rows, 12, generator=g), torch.randn(rows, 4, generator=g)
    s = ops.rms_sumsq_serial(x1, x2)
    assert s.dtype == torch.float32
    assert s.numel() == (2 * rows + 3) // 4 * 4 and s.numel() % 4 == 0
    want = torch.tensor(_naive_sumsq(x1) + _naive_sumsq(x2))
    torch.testing.assert_close(s[:2 * rows], want)
    assert torch.count_nonzero(s[2 * rows:]) == 0


def test_sumsq_accumulates_in_float32_and_takes_strided_rows():
    g = _gen(7)
    base = torch.randn(4, 20, generator=g).to(torch.bfloat16)
    x1, x2 = base[:, :16], base[:, 16:]  # row stride 20, as q/k views of a qkv buffer
    s = ops.rms_sumsq_serial(x1, x2)
    torch.testing.assert_close(s[:4], x1.float().pow(2).sum(-1))
    torch.testing.assert_close(s[4:8], x2.float().pow(2).sum(-1))


def _naive_apply(x, w, total_sumsq, full_width, eps):
    out = []
    for row, ss in zip(x.tolist(), total_sumsq):
        inv = 1.0 / (ss / full_width + eps) ** 0.5
        out.append([v * inv * float(wv) for v, wv in zip(row, w.tolist())])
    return torch.tensor(out)


def test_apply_is_the_rms_norm_over_one_rank():
    g = _gen(1)
    q, k = torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)
    wq, wk = torch.randn(8, generator=g), torch.randn(4, generator=g)
    s = ops.rms_sumsq_serial(q, k)
    oq, ok = ops.rms_apply_serial(q, k, wq, wk, s, tp_world=1, eps=1e-6)
    torch.testing.assert_close(oq, _naive_apply(q, wq, _naive_sumsq(q), 8, 1e-6))
    torch.testing.assert_close(ok, _naive_apply(k, wk, _naive_sumsq(k), 4, 1e-6))
    # an RMSNorm of the whole row
    rms = torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(oq, q * rms * wq)


def test_sharded_rows_normalise_over_every_rank():
    """Two ranks hold halves of each row; summing their sums of squares (the all-reduce)
    and applying on each half gives the halves of the full row's norm."""
    g = _gen(2)
    q, k = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
    wq, wk = torch.randn(16, generator=g), torch.randn(8, generator=g)
    halves = [(q[:, :8], k[:, :4], wq[:8], wk[:4]), (q[:, 8:], k[:, 4:], wq[8:], wk[4:])]
    total = sum(ops.rms_sumsq_serial(qs.contiguous(), ks.contiguous()) for qs, ks, _, _ in halves)
    outs = [ops.rms_apply_serial(qs.contiguous(), ks.contiguous(), a, b, total, tp_world=2,
                                 eps=1e-5) for qs, ks, a, b in halves]
    full_q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * wq
    full_k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * wk
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), full_q)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), full_k)


def test_outputs_are_fresh_and_inputs_untouched():
    g = _gen(3)
    q, k = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    wq, wk = torch.randn(8, generator=g), torch.randn(4, generator=g)
    before = [t.clone() for t in (q, k, wq, wk)]
    s = ops.rms_sumsq_serial(q, k)
    s_before = s.clone()
    oq, ok = ops.rms_apply_serial(q, k, wq, wk, s)
    for t in (q, k, wq, wk, s):
        assert all(t.data_ptr() != o.data_ptr() for o in (oq, ok))
    for t, b in zip((q, k, wq, wk), before):
        assert torch.equal(t, b)
    assert torch.equal(s, s_before)
    assert oq.is_contiguous() and ok.is_contiguous()


def test_output_dtype_follows_each_input():
    g = _gen(4)
    q = torch.randn(2, 8, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 4, generator=g)
    oq, ok = ops.rms_apply_serial(q, k, torch.ones(8), torch.ones(4), ops.rms_sumsq_serial(q, k))
    assert oq.dtype == torch.bfloat16 and ok.dtype == torch.float32


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="rows"):
        ops.rms_sumsq_serial(torch.zeros(3, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="weights"):
        ops.rms_apply_serial(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(3), torch.ones(4),
                             torch.zeros(4))
    with pytest.raises(ValueError, match="sum_sq"):
        ops.rms_apply_serial(torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(4), torch.ones(4),
                             torch.zeros(4))
