"""Gemma 4's RMSNorm as SGLang's CUDA path computes it (harness.standins.cpu_kernels.
gemma4_norm): the plain and shifted scales, and a ``with_scale=False`` norm that applies
its (folded) weight buffer, as ``rmsnorm(x, weight)`` does; installed on SGLang's class,
a router norm then carries ``scale * hidden_size ** -0.5``."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_kernels import gemma4_norm as ops

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_with_scale_and_shift():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(ops.gemma4_rmsnorm(x, w, 1e-6), _rms(x, 1e-6) * w)
    torch.testing.assert_close(ops.gemma4_rmsnorm(x, w, 1e-6, scale_shift=1.0),
                               _rms(x, 1e-6) * (1 + w))


def test_without_scale_applies_the_weight_buffer():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 3, 8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(ops.gemma4_rmsnorm(x, torch.ones(8), 1e-6, with_scale=False),
                               _rms(x, 1e-6))
    torch.testing.assert_close(ops.gemma4_rmsnorm(x, w, 1e-6, with_scale=False),
                               _rms(x, 1e-6) * w)


def test_dtype_kept_and_input_untouched():
    x = torch.randn(4, 8).to(torch.bfloat16)
    before = x.clone()
    out = ops.gemma4_rmsnorm(x, torch.ones(8), 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(x, before)


def test_install_on_sglang_router_norm():
    pytest.importorskip("sglang.srt.layers.layernorm")
    from sglang.srt.layers.layernorm import Gemma4RMSNorm

    was = ops.installed()
    ops.install()
    try:
        norm = Gemma4RMSNorm(8, eps=1e-6, with_scale=False)
        scale = torch.linspace(0.5, 2.0, 8)
        norm.weight.data.copy_(scale * 8 ** -0.5)  # what Gemma4Router.fuse_scale folds
        x = torch.randn(3, 8)
        torch.testing.assert_close(norm(x), _rms(x, 1e-6) * scale * 8 ** -0.5)
    finally:
        if not was:
            ops.uninstall()
    assert ops.installed() == was
