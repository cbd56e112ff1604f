"""Qwen3.5's fused CPU ops (harness.standins.cpu_kernels.qwen3_5) against their
definitions: per-head Gemma RMSNorm, the interleaved ``[q_h, gate_h]`` projection split,
the contiguous GDN projection unpack, and the in-place sigmoid gate."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_kernels import qwen3_5 as ops

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def gemma_rmsnorm(x, w, eps):
    """Gemma's RMSNorm over the last dim: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_sigmoid_mul_in_place_flat_and_per_head_gate():
    g = _gen(1)
    x = torch.randn(5, 12, generator=g)
    gate = torch.randn(5, 12, generator=g)
    want = x * torch.sigmoid(gate)
    ptr = x.data_ptr()
    assert ops.fused_sigmoid_mul(x, gate) is None
    assert x.data_ptr() == ptr
    torch.testing.assert_close(x, want)
    # a [tokens, heads, head_dim] gate for a [tokens, heads * head_dim] input
    y = torch.randn(5, 12, generator=g)
    gate3 = torch.randn(5, 3, 4, generator=g)
    want = y * torch.sigmoid(gate3.reshape(5, 12))
    ops.fused_sigmoid_mul(y, gate3)
    torch.testing.assert_close(y, want)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.fused_sigmoid_mul(y, torch.randn(5, 11))


def test_qk_gemma_rmsnorm_per_head():
    g = _gen(2)
    q = torch.randn(6, 4 * 8, generator=g)
    k = torch.randn(6, 2 * 8, generator=g)
    wq, wk = torch.randn(8, generator=g), torch.randn(8, generator=g)
    q_out, k_out = ops.fused_qk_gemma_rmsnorm(q, k, wq, wk, 1e-6, 8)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, gemma_rmsnorm(q.view(6, 4, 8), wq, 1e-6).view(6, 32))
    torch.testing.assert_close(k_out, gemma_rmsnorm(k.view(6, 2, 8), wk, 1e-6).view(6, 16))
    assert q_out.data_ptr() != q.data_ptr()  # fresh outputs
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.fused_qk_gemma_rmsnorm(q, k, wq.bfloat16(), wk, 1e-6, 8)


def test_qk_gemma_rmsnorm_with_interleaved_gate():
    g = _gen(3)
    T, H, Hkv, D = 5, 3, 1, 8
    q = torch.randn(T, H, D, generator=g)
    gate = torch.randn(T, H, D, generator=g)
    q_gate = torch.cat([q, gate], dim=-1).reshape(T, H * D * 2)  # [q_h, gate_h] per head
    k = torch.randn(T, Hkv * D, generator=g)
    wq, wk = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q_out, k_out, gate_out = ops.fused_qk_gemma_rmsnorm_with_gate(q_gate, k, wq, wk, 1e-6, D, H)
    assert q_out.shape == (T * H, D) and k_out.shape == (T * Hkv, D) and gate_out.shape == (T * H, D)
    torch.testing.assert_close(q_out, gemma_rmsnorm(q, wq, 1e-6).reshape(-1, D))
    torch.testing.assert_close(k_out, gemma_rmsnorm(k.view(T, Hkv, D), wk, 1e-6).reshape(-1, D))
    assert torch.equal(gate_out, gate.reshape(-1, D))
    with pytest.raises(RuntimeError, match="is not"):
        ops.fused_qk_gemma_rmsnorm_with_gate(q_gate[:, :-1], k, wq, wk, 1e-6, D, H)


@pytest.mark.parametrize("hk, hv", [(2, 4), (1, 1), (2, 8)])
def test_qkvzba_contiguous_unpack(hk, hv):
    g = _gen(4)
    T, dk, dv = 7, 4, 6
    q = torch.randn(T, hk * dk, generator=g)
    k = torch.randn(T, hk * dk, generator=g)
    v = torch.randn(T, hv * dv, generator=g)
    z = torch.randn(T, hv * dv, generator=g)
    b = torch.randn(T, hv, generator=g)
    a = torch.randn(T, hv, generator=g)
    mixed_qkv, z_out, b_out, a_out = ops.fused_qkvzba_split_reshape_cat_contiguous(
        torch.cat([q, k, v, z], dim=-1), torch.cat([b, a], dim=-1), hk, hv, dk, dv)
    assert torch.equal(mixed_qkv, torch.cat([q, k, v], dim=-1))
    assert torch.equal(z_out, z.view(T, hv, dv))
    assert torch.equal(b_out, b) and torch.equal(a_out, a)
    assert all(t.is_contiguous() for t in (mixed_qkv, z_out, b_out, a_out))


def test_registered_ops_are_these_functions():
    ops.install()
    assert ops.install() == []
    g = _gen(5)
    x = torch.randn(3, 8, generator=g)
    gate = torch.randn(3, 8, generator=g)
    want = x * torch.sigmoid(gate)
    torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate)
    torch.testing.assert_close(x, want)
    q = torch.randn(3, 8, generator=g)
    w = torch.randn(4, generator=g)
    q_out, _ = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(q, q, w, w, 1e-6, 4)
    torch.testing.assert_close(q_out, gemma_rmsnorm(q.view(3, 2, 4), w, 1e-6).view(3, 8))
