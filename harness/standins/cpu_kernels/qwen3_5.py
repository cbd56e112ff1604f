"""Qwen3.5's fused CPU ops: pure-torch versions of the sgl-kernel ops qwen3_5.py binds.

SGLang 0.5.23's ``models/qwen3_5.py`` binds four sgl-kernel CPU ops at import on a CPU
engine (0.5.23 qwen3_5.py:283-298; the pin's qwen3_5.py has none), so the model class,
and with it ``Qwen3_5ForConditionalGeneration``, does not even register without them
(the model registry then falls back to transformers' implementation and refuses it). The
installed sgl-kernel is the CUDA build, which has none of them. Each version here is the
op as sgl-kernel's CPU build and SGLang's own GPU kernels define it (same arguments,
outputs and in-place update), computing in float32:

* ``fused_sigmoid_mul(input, gate) -> ()``: ``input *= sigmoid(gate)`` *in place*
  (qwen3_5.py:286-290 wraps it; the GPU op is ``kernels/ops/elementwise``'s
  ``fused_sigmoid_mul``), ``gate`` of ``input``'s shape or a view with its elements
  (``[tokens, heads, head_dim]`` for a ``[tokens, heads * head_dim]`` input).
* ``fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim) -> (q_out, k_out)``:
  Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)``) of every ``head_dim`` group of
  ``q`` and ``k``, outputs fresh and shaped like the inputs.
* ``fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim,
  num_head) -> (q, k, gate)``: ``q_gate`` is ``[tokens, num_head * head_dim * 2]``,
  interleaved per head as ``[q_h, gate_h]`` (the gated attention's q projection);
  returns the normed ``q`` ``[tokens * num_head, head_dim]``, the normed ``k``
  ``[tokens * num_kv_heads, head_dim]`` and the raw gate ``[tokens * num_head,
  head_dim]``.
* ``fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk,
  num_heads_v, head_qk, head_v) -> (mixed_qkv, z, b, a)``: the Qwen3.5 (contiguous)
  GDN projection layout ``[all_q | all_k | all_v | all_z]`` and ``[all_b | all_a]``
  unpacked into fresh ``mixed_qkv`` ``[tokens, q + k + v]``, ``z`` ``[tokens, num_heads_v,
  head_v]``, ``b`` and ``a`` ``[tokens, num_heads_v]`` (0.5.23
  ``kernels/ops/attention/triton_gdn_fused_proj.py``'s
  ``fused_qkvzba_split_reshape_cat_contiguous``).

The C++ kernels take bfloat16/float16 only; these also take float32 (the parity tier's
dtype). :func:`install` registers them as ``torch.ops.sgl_kernel.<name>_cpu`` where
missing (none of these names is a feature probe SGLang tests with ``hasattr``).
Stdlib-only at import time.
"""

from __future__ import annotations

import sys

SCHEMAS: dict[str, str] = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim) -> (Tensor, Tensor)"
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, "
        "Tensor k_weight, float eps, int head_dim, int num_head) -> (Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, "
        "int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    ),
}
FUNCTIONS: dict[str, str] = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul",
    "fused_qk_gemma_rmsnorm_cpu": "fused_qk_gemma_rmsnorm",
    "fused_qk_gemma_rmsnorm_with_gate_cpu": "fused_qk_gemma_rmsnorm_with_gate",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": "fused_qkvzba_split_reshape_cat_contiguous",
}


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{op} (CPU stand-in, harness.standins.cpu_kernels.qwen3_5): {what}")


def fused_sigmoid_mul(input, gate) -> None:
    """sgl-kernel's ``fused_sigmoid_mul_cpu``: ``input *= sigmoid(gate)`` in place."""
    import torch

    _check(gate.numel() == input.numel(), "fused_sigmoid_mul_cpu",
           f"gate {tuple(gate.shape)} does not match input {tuple(input.shape)}")
    prod = input.float() * torch.sigmoid(gate.reshape(input.shape).float())
    input.copy_(prod.to(input.dtype))


def _gemma_rms(x, weight, eps: float, head_dim: int):
    """Gemma RMSNorm of each ``head_dim`` group of ``x`` (any shape): ``[groups, head_dim]``."""
    import torch

    groups = x.reshape(-1, head_dim).float()
    inv = torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)
    return groups * inv * (1.0 + weight.float())


def fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """sgl-kernel's ``fused_qk_gemma_rmsnorm_cpu``: per-head Gemma RMSNorm of q and k."""
    op = "fused_qk_gemma_rmsnorm_cpu"
    _check(q.shape[-1] % head_dim == 0 and k.shape[-1] % head_dim == 0, op,
           f"the last dims of q {tuple(q.shape)} and k {tuple(k.shape)} are not heads of {head_dim}")
    _check(q_weight.numel() == head_dim and k_weight.numel() == head_dim, op,
           f"expect q/k weights of {head_dim}")
    _check(k.dtype == q.dtype and q_weight.dtype == q.dtype and k_weight.dtype == q.dtype, op,
           "q, k and the weights must share a dtype")
    q_out = _gemma_rms(q, q_weight, eps, head_dim).to(q.dtype).reshape(q.shape)
    k_out = _gemma_rms(k, k_weight, eps, head_dim).to(k.dtype).reshape(k.shape)
    return q_out, k_out


def fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps: float, head_dim: int,
                                     num_head: int):
    """sgl-kernel's ``fused_qk_gemma_rmsnorm_with_gate_cpu`` (module docstring)."""
    op = "fused_qk_gemma_rmsnorm_with_gate_cpu"
    _check(q_gate.dim() == 2 and k.dim() == 2, op, "expect 2D q_gate and k")
    T = q_gate.shape[0]
    _check(q_gate.shape[1] == num_head * head_dim * 2, op,
           f"q_gate {tuple(q_gate.shape)} is not [T, {num_head} * {head_dim} * 2]")
    _check(k.shape[0] == T and k.shape[1] % head_dim == 0, op, f"k {tuple(k.shape)} does not match")
    _check(k.dtype == q_gate.dtype and q_weight.dtype == q_gate.dtype
           and k_weight.dtype == q_gate.dtype, op, "q_gate, k and the weights must share a dtype")
    pairs = q_gate.reshape(T, num_head, 2, head_dim)
    q = _gemma_rms(pairs[:, :, 0], q_weight, eps, head_dim).to(q_gate.dtype)
    gate = pairs[:, :, 1].reshape(T * num_head, head_dim).clone()
    k_out = _gemma_rms(k, k_weight, eps, head_dim).to(k.dtype)
    return q, k_out, gate


def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk: int,
                                              num_heads_v: int, head_qk: int, head_v: int):
    """sgl-kernel's ``fused_qkvzba_split_reshape_cat_contiguous_cpu`` (module docstring)."""
    op = "fused_qkvzba_split_reshape_cat_contiguous_cpu"
    T = mixed_qkvz.shape[0]
    qkv = num_heads_qk * head_qk * 2 + num_heads_v * head_v
    _check(mixed_qkvz.dim() == 2 and mixed_qkvz.shape[1] == qkv + num_heads_v * head_v, op,
           f"mixed_qkvz {tuple(mixed_qkvz.shape)} is not [T, {qkv + num_heads_v * head_v}]")
    _check(tuple(mixed_ba.shape) == (T, 2 * num_heads_v), op,
           f"mixed_ba {tuple(mixed_ba.shape)} is not [{T}, {2 * num_heads_v}]")
    _check(num_heads_v % num_heads_qk == 0, op, "num_heads_v must be a multiple of num_heads_qk")
    mixed_qkv = mixed_qkvz[:, :qkv].contiguous()
    z = mixed_qkvz[:, qkv:].reshape(T, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v:].contiguous()
    return mixed_qkv, z, b, a


def install() -> list[str]:
    """Register every op of :data:`SCHEMAS` that ``torch.ops.sgl_kernel`` lacks (CPU
    dispatch key); returns the names registered. Idempotent."""
    from harness.standins.cpu_kernels import register_ops as register

    this = sys.modules[__name__]
    return register(SCHEMAS, {name: getattr(this, FUNCTIONS[name]) for name in SCHEMAS})
