"""Triton's interpreter multiplies bfloat16 ``tl.dot`` operands as raw bits.

The interpreter (``TRITON_INTERPRET=1``, how SGLang's Triton kernels run on this CPU)
stores bfloat16 values as their uint16 bit patterns, and its ``create_dot`` converts
only fp8 operands before ``np.matmul``: a bf16 dot multiplies the integers behind the
bits (errors of 1e10 on unit-sized inputs; Triton 3.6 and 3.8). Every bf16 attention
kernel of SGLang's triton backend goes through ``tl.dot``, which is why a bf16 engine
under the interpreter generated wrong tokens.

The GPU's dot takes bf16 operands and accumulates in the accumulator's type; so does
this version: bf16 operands are widened to float32 (exactly: a bf16 is the top half of
a float32) before the interpreter's own matmul. Other dtypes go to the original.
"""

from __future__ import annotations

from types import ModuleType

_MARK = "__harness_cpu_engine__"


def widen_bf16_bits(bits):
    """float32 values of bf16 numbers given as their uint16 bit patterns (numpy)."""
    import numpy as np

    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def patch(interpreter: ModuleType) -> None:
    """Fix ``InterpreterBuilder.create_dot`` in ``triton.runtime.interpreter`` (once)."""
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, _MARK, False):
        return
    import triton.language as tl

    original = builder.create_dot
    handle = interpreter.TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = handle(widen_bf16_bits(a.data), tl.float32)
        if b.dtype == tl.bfloat16:
            b = handle(widen_bf16_bits(b.data), tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _MARK, True)
    create_dot.__wrapped__ = original
    builder.create_dot = create_dot
