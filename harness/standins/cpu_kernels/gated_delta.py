"""Gated DeltaNet on the CPU: pure-torch versions of sgl-kernel's CPU ``mamba`` ops.

On a CPU engine (``SGLANG_USE_CPU_ENGINE=1``) SGLang's GDN linear-attention backend
(``layers/attention/linear/gdn_backend.py`` and ``kernels/gdn_triton.py`` at both bases)
takes its kernels from sgl-kernel's CPU build: ``sgl_kernel.mamba``'s
``causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu`` / ``chunk_gated_delta_rule_cpu``
(thin Python wrappers around ``torch.ops.sgl_kernel.*_cpu``) and the ops
``fused_gdn_gating_cpu`` and ``fused_sigmoid_gating_delta_rule_update_cpu`` directly.
The sgl-kernel wheel the locks install is the CUDA build, which has none of these ops
(and on a machine without a GPU driver does not import at all), so the GDN path has no
CPU kernel here. This module is those five ops, same arguments and outputs, same
in-place state updates, as sgl-kernel's ``csrc/cpu/mamba/{conv,fla}.cpp`` define them:

* ``causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices,
  has_initial_state, silu_activation, pad_slot_id, is_vnni) -> out``: depthwise causal
  conv over each sequence of ``x`` (``[dim, total_tokens]``, the transpose of a
  contiguous ``[tokens, dim]``; or ``[batch, dim, seqlen]``), left context from
  ``conv_states[cache_indices[i]]`` (``[dim, width - 1]``, oldest first) when
  ``has_initial_state[i]``, zeros otherwise; optional SiLU; ``out`` has ``x``'s layout.
  Each sequence's state row is then overwritten *in place* with its last ``width - 1``
  inputs (left context included when the sequence is shorter).
* ``causal_conv1d_update(x, conv_states, weight, bias, silu_activation, cache_seqlens,
  conv_state_indices, pad_slot_id, is_vnni) -> out``: one decode token per row of ``x``
  (``[batch, dim]``) against its state row, which then shifts left by one *in place*.
* ``fused_gdn_gating(A_log, a, b, dt_bias) -> (g, beta)``: ``g = -exp(A_log) *
  softplus(a + dt_bias)`` in float32 and ``beta = sigmoid(b)`` in ``b``'s dtype, both
  ``[1, tokens, heads]``.
* ``chunk_gated_delta_rule(query, key, value, g, beta, initial_state,
  output_final_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
  initial_state_indices=None, eps=1e-5) -> (out, final_state)``: the gated delta rule
  per sequence of ``cu_seqlens`` (``[1, T, H, K]`` queries/keys, ``[1, T, HV, V]``
  values, ``HV`` a multiple of ``H``; states ``[HV, K, V]``), computed chunkwise (64
  tokens, WY form) like the C++ kernel. ``final_state`` is
  ``initial_state.to(float32)``, so for a float32 ``initial_state`` (what SGLang
  passes) it *is* ``initial_state``, updated in place. With ``initial_state_indices``
  (sgl-kernel 0.4.10, SGLang 0.5.23's wrapper) ``initial_state`` is the whole state
  pool: sequence ``i`` starts from row ``initial_state_indices[i]`` and its final
  state is written back to that row in place; the returned ``final_state`` is then
  the per-sequence stack (0.5.23's CPU path does not read it).
* ``fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b,
  initial_state_source, initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
  softplus_beta=1.0, softplus_threshold=20.0) -> out``: the decode step, gating fused
  in, state rows of ``initial_state_source`` updated in place; ``out`` is
  ``[batch, seq_len, HV, V]``.

Where these differ from the C++ kernels, on purpose:

* dtypes: the C++ kernels take bfloat16/float16 activations only; these also take
  float32 (the parity tier runs float32), computing in float32 throughout.
* ``is_vnni``: the C++ conv kernels read a weight pre-packed by
  ``causal_conv1d_weight_pack`` when ``is_vnni`` is true, which SGLang's AMX path does
  at load time (``layers/amx_utils.py``). Without sgl-kernel's CPU build that path is
  off (``cpu_has_amx_support()`` is false) and no weight is ever packed, so the
  ``weight`` here is always the logical ``[dim, width]`` one and ``is_vnni`` is
  accepted and ignored. ``causal_conv1d_weight_pack`` is not provided.
* the C++ ``causal_conv1d_*`` restride ``conv_states`` in place to be contiguous on
  ``dim`` (same logical values); these leave its strides alone.

:func:`install` registers the ops as ``torch.ops.sgl_kernel.<name>_cpu`` (only those
not already registered: a real CPU build of sgl-kernel keeps its own) and, when the
process's ``sgl_kernel`` is the CPU engine stand-in (a plain module), makes
``sgl_kernel.mamba`` importable: the installed sgl-kernel's own ``mamba.py`` wrappers
(they import only torch), so SGLang's calls go through the real argument mapping.
Stdlib-only at import time.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Optional

CHUNK_SIZE = 64

# op name (torch.ops.sgl_kernel.<name>) -> its schema (sgl-kernel's, plus 0.4.10's
# ``initial_state_indices``); FUNCTIONS: op name -> function of this module
SCHEMAS: dict[str, str] = {
    "causal_conv1d_fwd_cpu": (
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, "
        "bool silu_activation, int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    "causal_conv1d_update_cpu": (
        "causal_conv1d_update_cpu(Tensor x, Tensor conv_states, Tensor weight, Tensor? bias, "
        "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, "
        "int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    "fused_gdn_gating_cpu": (
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)"
    ),
    "chunk_gated_delta_rule_cpu": (
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, "
        "Tensor beta, Tensor initial_state, bool output_final_state, Tensor cu_seqlens, "
        "bool head_first, bool use_qk_l2norm_in_kernel, Tensor? initial_state_indices=None, "
        "float eps=1e-05) -> (Tensor, Tensor)"
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, "
        "Tensor k, Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, "
        "Tensor initial_state_indices, Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, "
        "float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor"
    ),
}
FUNCTIONS: dict[str, str] = {
    "causal_conv1d_fwd_cpu": "causal_conv1d_fwd",
    "causal_conv1d_update_cpu": "causal_conv1d_update",
    "fused_gdn_gating_cpu": "fused_gdn_gating",
    "chunk_gated_delta_rule_cpu": "chunk_gated_delta_rule",
    "fused_sigmoid_gating_delta_rule_update_cpu": "fused_sigmoid_gating_delta_rule_update",
}


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{op} (CPU stand-in, harness.standins.cpu_kernels.gated_delta): {what}")


def _act(x, silu: bool):
    import torch.nn.functional as F

    return F.silu(x) if silu else x


# ------------------------------------------------------------------ causal conv1d


def _conv_sequence(xs, weight, bias, left, silu: bool):
    """Causal depthwise conv of one sequence ``xs`` (``[dim, L]``) with left context
    ``left`` (``[dim, width - 1]``); returns ``(out [dim, L] float32, window)`` where
    ``window`` is the context and inputs concatenated (``[dim, width - 1 + L]``)."""
    import torch

    width = weight.shape[-1]
    window = torch.cat([left.float(), xs.float()], dim=-1)
    L = xs.shape[-1]
    w = weight.float()
    acc = torch.zeros_like(window[:, :L])
    for k in range(width):
        acc = acc + w[:, k:k + 1] * window[:, k:k + L]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return _act(acc, silu), window


def causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices,
                      has_initial_state, silu_activation: bool, pad_slot_id: int,
                      is_vnni: bool):
    """sgl-kernel's ``causal_conv1d_fwd_cpu`` (see the module docstring)."""
    import torch

    op = "causal_conv1d_fwd_cpu"
    varlen = query_start_loc is not None
    _check(x.dim() == (2 if varlen else 3), op, f"expect x to be {2 if varlen else 3}D tensor")
    _check(x.stride(-2) == 1 and x.stride(-1) == x.size(-2), op, "expect x to be transposed")
    _check(weight.dim() == 2 and weight.is_contiguous(), op, "weight must be a contiguous [dim, width]")
    _check(weight.dtype == x.dtype, op, f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    dim, width = x.size(-2), weight.size(-1)
    _check(weight.size(0) == dim, op, f"weight has {weight.size(0)} channels, x has {dim}")
    if bias is not None:
        _check(bias.shape == (dim,) and bias.dtype == x.dtype, op, "bias must be [dim] of x's dtype")
    batch = query_start_loc.numel() - 1 if varlen else x.size(0)
    if conv_states is not None:
        _check(conv_states.dtype == x.dtype, op,
               f"conv_states dtype {conv_states.dtype} != x dtype {x.dtype}")
        _check(conv_states.size(0) >= batch and tuple(conv_states.shape[1:]) == (dim, width - 1),
               op, f"conv_states {tuple(conv_states.shape)} is not [>= {batch}, {dim}, {width - 1}]")
    out = torch.empty_like(x)
    for i in range(batch):
        if varlen:
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            xs = x[:, start:end]
        else:
            xs = x[i]
        slot = int(cache_indices[i]) if cache_indices is not None else i
        use_state = (conv_states is not None and has_initial_state is not None
                     and bool(has_initial_state[i]))
        left = (conv_states[slot] if use_state
                else torch.zeros(dim, width - 1, dtype=torch.float32, device=x.device))
        res, window = _conv_sequence(xs, weight, bias, left, silu_activation)
        if varlen:
            out[:, start:end] = res.to(out.dtype)
        else:
            out[i] = res.to(out.dtype)
        if conv_states is not None:
            conv_states[slot] = window[:, window.shape[-1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update(x, conv_states, weight, bias, silu_activation: bool, cache_seqlens,
                         conv_state_indices, pad_slot_id: int, is_vnni: bool):
    """sgl-kernel's ``causal_conv1d_update_cpu`` (see the module docstring)."""
    op = "causal_conv1d_update_cpu"
    _check(x.dim() == 2 and x.is_contiguous(), op, "expect x to be a contiguous 2D tensor")
    _check(cache_seqlens is None, op, "don't support cache_seqlens")
    _check(weight.dtype == x.dtype and conv_states.dtype == x.dtype, op,
           "weight and conv_states must have x's dtype")
    batch, dim = x.shape
    width = weight.size(-1)
    _check(tuple(conv_states.shape[1:]) == (dim, width - 1), op,
           f"conv_states {tuple(conv_states.shape)} is not [N, {dim}, {width - 1}]")
    out = x.new_empty(x.shape)
    for i in range(batch):
        slot = int(conv_state_indices[i]) if conv_state_indices is not None else i
        res, window = _conv_sequence(x[i:i + 1].t(), weight, bias, conv_states[slot], silu_activation)
        out[i] = res[:, 0].to(out.dtype)
        conv_states[slot] = window[:, 1:].to(conv_states.dtype)
    return out


# ------------------------------------------------------------------ gating


def _softplus(x, beta: float = 1.0, threshold: float = 20.0):
    import torch.nn.functional as F

    return F.softplus(x, beta=beta, threshold=threshold)


def fused_gdn_gating(A_log, a, b, dt_bias):
    """sgl-kernel's ``fused_gdn_gating_cpu``: ``(g [1, B, H] float32, beta [1, B, H])``."""
    import torch

    op = "fused_gdn_gating_cpu"
    _check(A_log.dim() == 1 and a.dim() == 2 and b.dim() == 2 and dt_bias.dim() == 1, op,
           "expect A_log [H], a [B, H], b [B, H], dt_bias [H]")
    _check(a.shape == b.shape and A_log.numel() == a.size(1) == dt_bias.numel(), op,
           "head counts of A_log, a, b, dt_bias differ")
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


# ------------------------------------------------------------------ gated delta rule


def _l2norm(x, eps: float):
    import torch

    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _chunked_sequence(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """One sequence, chunkwise (WY form). ``q``/``k`` ``[L, H, K]`` (scaled and normed,
    heads already repeated to ``H``), ``v`` ``[L, H, V]``, ``g``/``beta`` ``[L, H]``,
    ``state`` ``[H, K, V]``; all float32. Returns ``(out [L, H, V], final state)``."""
    import torch

    L = q.shape[0]
    pad = (chunk_size - L % chunk_size) % chunk_size

    def chunks(t):  # [L, H, ...] -> [H, n, C, ...] (zero padded)
        t = t.transpose(0, 1)
        if pad:
            t = torch.cat([t, t.new_zeros((t.shape[0], pad, *t.shape[2:]))], dim=1)
        return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    gc = g.cumsum(dim=-1)  # per chunk
    decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()  # [H, n, C, C]
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(diagonal=-1)
    # T = (I + strictly-lower(k_beta k^T * decay))^-1: the WY transform of the chunk
    wy = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False)
    u = wy @ v_beta
    w = wy @ (k_beta * gc.exp()[..., None])
    out = torch.empty_like(u)
    for i in range(q.shape[1]):
        q_i, k_i, g_i = q[:, i], k[:, i], gc[:, i]
        attn = (q_i @ k_i.transpose(-1, -2)) * decay[:, i]
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = (q_i * g_i.exp()[..., None]) @ state + attn @ v_new
        g_last = g_i[:, -1]
        state = (state * g_last.exp()[:, None, None]
                 + (k_i * (g_last[:, None] - g_i).exp()[..., None]).transpose(-1, -2) @ v_new)
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :L]
    return out.transpose(0, 1), state


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state: bool,
                           cu_seqlens, head_first: bool, use_qk_l2norm_in_kernel: bool,
                           initial_state_indices=None, eps: float = 1e-5):
    """sgl-kernel's ``chunk_gated_delta_rule_cpu`` (see the module docstring)."""
    import torch

    op = "chunk_gated_delta_rule_cpu"
    _check(not head_first, op, "does not support head first")
    _check(query.dim() == 4 and key.shape == query.shape and value.dim() == 4, op,
           "expect query/key [1, T, H, K] and value [1, T, HV, V]")
    B, T, H, K = query.shape
    HV, V = value.shape[2], value.shape[3]
    _check(B == 1 and value.shape[:2] == (B, T), op, "expect one packed batch [1, T, ...]")
    _check(HV % H == 0, op, "expect v_num_head multiple of qk_num_head")
    _check(g.dtype == torch.float32 and tuple(g.shape) == (B, T, HV), op, "expect g [1, T, HV] float32")
    _check(tuple(beta.shape) == (B, T, HV), op, "expect beta [1, T, HV]")
    _check(initial_state.dtype == torch.float32, op, "expect a float32 initial_state")
    _check(cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, op, "expect int32 cu_seqlens")
    N = cu_seqlens.numel() - 1
    if initial_state_indices is None:
        _check(tuple(initial_state.shape) == (N, HV, K, V), op,
               f"initial_state {tuple(initial_state.shape)} is not [{N}, {HV}, {K}, {V}]")
        # The kernel's ``initial_state.to(at::kFloat)``: the same tensor when float32.
        final_state = initial_state.to(torch.float32)
    else:
        _check(initial_state_indices.numel() == N, op, "one initial_state index per sequence")
        _check(tuple(initial_state.shape[1:]) == (HV, K, V), op,
               f"initial_state {tuple(initial_state.shape)} is not [S, {HV}, {K}, {V}]")
        rows = initial_state_indices.long()
        final_state = initial_state[rows].to(torch.float32)
    q = query[0].float()
    k = key[0].float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q, eps), _l2norm(k, eps)
    q = q * (K ** -0.5)
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=1)
        k = k.repeat_interleave(HV // H, dim=1)
    v = value[0].float()
    out = torch.empty_like(value)
    for n in range(N):
        s, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, st = _chunked_sequence(q[s:e], k[s:e], v[s:e], g[0, s:e], beta[0, s:e].float(),
                                  final_state[n].clone())
        out[0, s:e] = o.to(out.dtype)
        final_state[n].copy_(st)
    if initial_state_indices is not None:
        initial_state[rows] = final_state.to(initial_state.dtype)
    return out, final_state


def fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                           initial_state_indices, cu_seqlens,
                                           use_qk_l2norm_in_kernel: bool,
                                           softplus_beta: float = 1.0,
                                           softplus_threshold: float = 20.0):
    """sgl-kernel's ``fused_sigmoid_gating_delta_rule_update_cpu`` (module docstring)."""
    import torch

    op = "fused_sigmoid_gating_delta_rule_update_cpu"
    _check(q.dim() == 4 and k.shape == q.shape and v.dim() == 4, op,
           "expect q/k [S, B, H, K] and v [S, B, HV, V]")
    S, Bt, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check(v.shape[:2] == (S, Bt) and HV % H == 0, op, "v does not match q")
    _check(tuple(a.shape) == (Bt, HV) and tuple(b.shape) == (Bt, HV), op, "expect a, b [B, HV]")
    _check(initial_state_indices.numel() == Bt and cu_seqlens.numel() == Bt + 1, op,
           "one state index per batch row, cu_seqlens [B + 1]")
    _check(initial_state_source.dtype == torch.float32
           and tuple(initial_state_source.shape[1:]) == (HV, K, V), op,
           f"initial_state_source {tuple(initial_state_source.shape)} is not float32 [N, {HV}, {K}, {V}]")
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), softplus_beta,
                                             softplus_threshold)  # [B, HV]
    beta = torch.sigmoid(b.float())
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf, 1e-6), _l2norm(kf, 1e-6)
    qf = qf * (K ** -0.5)
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)
    vf = v.float()
    out = torch.empty((Bt, S, HV, V), dtype=q.dtype, device=q.device)
    for j in range(Bt):
        row = int(initial_state_indices[j])
        state = initial_state_source[row].clone()  # [HV, K, V]
        for t in range(S):
            state = state * g[j].exp()[:, None, None]
            kv_mem = torch.einsum("hk,hkv->hv", kf[t, j], state)
            delta = (vf[t, j] - kv_mem) * beta[j][:, None]
            state = state + kf[t, j][:, :, None] * delta[:, None, :]
            out[j, t] = torch.einsum("hk,hkv->hv", qf[t, j], state).to(out.dtype)
        initial_state_source[row] = state
    return out


# ------------------------------------------------------------------ installing

def register_ops() -> list[str]:
    """Register every op of :data:`SCHEMAS` that ``torch.ops.sgl_kernel`` lacks (CPU
    dispatch key); returns the names registered. Idempotent."""
    from harness.standins.cpu_kernels import register_ops as register

    this = sys.modules[__name__]
    return register(SCHEMAS, {name: getattr(this, FUNCTIONS[name]) for name in SCHEMAS})


def _real_mamba_wrappers() -> Optional[str]:
    """Path of the installed sgl-kernel's ``mamba.py``, found without importing the
    package (its ``__init__`` needs a GPU driver)."""
    spec = importlib.machinery.PathFinder.find_spec("sgl_kernel")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "mamba.py")
        if os.path.isfile(path):
            return path
    return None


def provide_mamba_module() -> str:
    """Make ``import sgl_kernel.mamba`` work when ``sgl_kernel`` is the CPU engine
    stand-in (a plain module): load the installed sgl-kernel's own ``mamba.py`` as
    ``sgl_kernel.mamba``. Returns what was done ("real", "loaded" or "present")."""
    import sgl_kernel

    if "sgl_kernel.mamba" in sys.modules:
        return "present"
    if getattr(sgl_kernel, "__path__", None) is not None:  # the real package
        importlib.import_module("sgl_kernel.mamba")
        return "real"
    path = _real_mamba_wrappers()
    if path is None:
        raise RuntimeError("no installed sgl-kernel mamba.py to wrap the CPU GDN ops")
    spec = importlib.util.spec_from_file_location("sgl_kernel.mamba", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sgl_kernel.mamba"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["sgl_kernel.mamba"]
        raise
    setattr(sgl_kernel, "mamba", module)
    return "loaded"


def install() -> dict:
    """Register the ops and make ``sgl_kernel.mamba`` importable (see the module
    docstring); safe to call more than once."""
    return {"ops": register_ops(), "mamba": provide_mamba_module()}
