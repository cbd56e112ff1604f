"""The Triton interpreter's bfloat16 ``tl.dot`` (harness.standins.cpu_engine.triton_interp):
wrong as shipped (it multiplies the bit patterns), exact once widened to float32."""

from __future__ import annotations

import pytest
import torch

from harness.standins.cpu_engine import triton_interp

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


@pytest.fixture(scope="module")
def dot_kernel():
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def dot(a, b, out, N: tl.constexpr):
        r = tl.arange(0, N)
        x = tl.load(a + r[:, None] * N + r[None, :])
        y = tl.load(b + r[:, None] * N + r[None, :])
        tl.store(out + r[:, None] * N + r[None, :], tl.dot(x, y))

    return InterpretedFunction(dot.fn)


@pytest.fixture
def patched_interpreter(monkeypatch):
    import triton.runtime.interpreter as interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", interpreter.InterpreterBuilder.create_dot)
    triton_interp.patch(interpreter)
    triton_interp.patch(interpreter)  # idempotent
    assert getattr(interpreter.InterpreterBuilder.create_dot, "__wrapped__", None) is not None
    return interpreter


def _operands(dtype):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 16, generator=gen).to(dtype), torch.randn(16, 16, generator=gen).to(dtype)


def test_widening_is_exact():
    import numpy as np

    x = torch.randn(64).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    assert torch.equal(torch.from_numpy(triton_interp.widen_bf16_bits(bits)), x.float())


def test_shipped_interpreter_gets_bf16_dot_wrong(dot_kernel, monkeypatch):
    import triton.runtime.interpreter as interpreter

    original = getattr(interpreter.InterpreterBuilder.create_dot, "__wrapped__", interpreter.InterpreterBuilder.create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", original)
    a, b = _operands(torch.bfloat16)
    out = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, out, 16)
    assert (out - a.float() @ b.float()).abs().max() > 1e3  # the bug this stand-in exists for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_patched_dot_matches_torch(dot_kernel, patched_interpreter, dtype):
    a, b = _operands(dtype)
    out = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, out, 16)
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-5, atol=1e-4)
