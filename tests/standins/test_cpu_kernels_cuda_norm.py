"""SGLang's CUDA RMSNorm path on the CPU (harness.standins.cpu_kernels.cuda_norm): the
sgl-kernel norm ops against their definition, with the kernels' aliasing (the fused ones
write their input and residual in place and return nothing, the plain ones leave their
input alone), and SGLang's own norms routed to ``forward_cuda`` over them: in place with
a residual, 0.5.23's ``Gemma3RMSNorm(h, residual)`` too; the pin's ``Gemma3RMSNorm``
has no residual form and stays out of place."""

from __future__ import annotations

import pytest
import torch

from harness.patchset.layout import layout
from harness.standins import kernels
from harness.standins.cpu_kernels import cuda_norm as ops

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

EPS = 1e-6


def _rms(x, w, gemma=False):
    x = x.double()
    out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return out * (1 + w.double() if gemma else w.double())


def _inputs(seed, rows=3, dim=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g),
            torch.randn(dim, generator=g))


@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma_rmsnorm"])
def test_plain_norm_is_out_of_place(gemma):
    x, _, w = _inputs(0)
    before = x.clone()
    out = (ops.gemma_rmsnorm if gemma else ops.rmsnorm)(x, w, EPS)
    assert out.data_ptr() != x.data_ptr() and torch.equal(x, before)
    torch.testing.assert_close(out.double(), _rms(x, w, gemma))


@pytest.mark.parametrize("gemma", [False, True], ids=["fused_add_rmsnorm", "gemma_fused_add"])
def test_fused_add_norm_writes_input_and_residual(gemma):
    x, residual, w = _inputs(1)
    want_residual = x + residual
    want = _rms(want_residual, w, gemma)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    fn = ops.gemma_fused_add_rmsnorm if gemma else ops.fused_add_rmsnorm
    assert fn(x, residual, w, EPS) is None
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, r_ptr)
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(x.double(), want)


def test_calls_are_counted():
    x, residual, w = _inputs(2)
    before = kernels.PATHS.copy()
    ops.fused_add_rmsnorm(x, residual, w, EPS)
    ops.rmsnorm(x, w, EPS)
    assert kernels.paths_since(before) == {"fused_add_rmsnorm": 1, "rmsnorm": 1}


def _layernorm():
    return pytest.importorskip("sglang.srt.layers.layernorm")


@pytest.mark.parametrize("cls_name, gemma", [("RMSNorm", False), ("GemmaRMSNorm", True)])
def test_sglang_norm_with_a_residual_runs_in_place(cls_name, gemma):
    layernorm = _layernorm()
    norm = getattr(layernorm, cls_name)(8, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8) + (0.0 if gemma else 1.0))
    assert ops.install(norm) == 1
    x, residual, _ = _inputs(3)
    want_residual = x + residual
    want = _rms(want_residual, norm.weight.data, gemma)
    out, res = norm(x, residual)
    assert out is x and res is residual, "forward_cuda returns the tensors the kernel wrote"
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(x.double(), want)
    y, _, _ = _inputs(4)
    before = y.clone()
    torch.testing.assert_close(norm(y).double(), _rms(y, norm.weight.data, gemma))
    assert torch.equal(y, before)


def test_gemma3_rmsnorm_with_a_residual():
    """0.5.23: ``gemma_fused_add_rmsnorm`` in place (layernorm.py Gemma3RMSNorm.forward_cuda);
    the pin's Gemma3RMSNorm takes no residual and its forward_cuda is forward_native."""
    layernorm = _layernorm()
    norm = layernorm.Gemma3RMSNorm(8, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    assert ops.install(norm) == 1
    x, residual, _ = _inputs(5)
    if layout().base is None:  # the pin
        before = x.clone()
        torch.testing.assert_close(norm(x).double(), _rms(x, norm.weight.data, gemma=True))
        assert torch.equal(x, before)
        return
    want_residual = x + residual
    want = _rms(want_residual, norm.weight.data, gemma=True)
    out, res = norm(x, residual)
    assert out is x and res is residual
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(x.double(), want)
