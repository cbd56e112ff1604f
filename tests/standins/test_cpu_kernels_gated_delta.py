"""The pure-torch Gated DeltaNet ops (harness.standins.cpu_kernels.gated_delta) against
their definitions: the gated delta rule as a token-by-token recurrence, the causal conv
as ``torch.nn.functional.conv1d`` over the left context and the inputs, the gating
formula; and the state each op updates in place (rows it must write, rows it must leave
alone, the float32 ``initial_state`` that *is* the returned final state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.standins.cpu_kernels import gated_delta as gd

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

ROOT = Path(__file__).resolve().parents[2]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _gdr_inputs(lens, H=2, HV=4, K=8, V=6, seed=0, key_scale=1.0):
    g = _gen(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=g)
    k = torch.randn(1, T, H, K, generator=g) * key_scale
    v = torch.randn(1, T, HV, V, generator=g)
    gate = -torch.rand(1, T, HV, generator=g) * 0.7
    beta = torch.rand(1, T, HV, generator=g)
    state = torch.randn(len(lens), HV, K, V, generator=g) * 0.1
    return q, k, v, gate, beta, state


def recurrence(q, k, v, g, beta, cu, state, l2norm, eps=1e-5):
    """The gated delta rule, one token at a time: S <- exp(g) S; S <- S + k (beta (v -
    k S)); o = (q / sqrt(K)) S, per value head (query/key heads shared by HV / H)."""
    H, K = q.shape[2], q.shape[3]
    HV = v.shape[2]
    out = torch.empty_like(v)
    final = state.clone()
    for n in range(cu.numel() - 1):
        S = state[n].clone()
        for t in range(int(cu[n]), int(cu[n + 1])):
            qt, kt = q[0, t], k[0, t]
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + eps)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + eps)
            qt = qt.repeat_interleave(HV // H, 0) * K ** -0.5
            kt = kt.repeat_interleave(HV // H, 0)
            S = S * g[0, t].exp()[:, None, None]
            delta = (v[0, t] - torch.einsum("hk,hkv->hv", kt, S)) * beta[0, t][:, None]
            S = S + kt[:, :, None] * delta[:, None, :]
            out[0, t] = torch.einsum("hk,hkv->hv", qt, S)
        final[n] = S
    return out, final


# ------------------------------------------------------------------ chunk_gated_delta_rule

LENS = [[1], [5, 7], [63, 64, 65], [1, 130, 2]]


@pytest.mark.parametrize("lens", LENS, ids=lambda lens: "-".join(map(str, lens)))
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_chunk_matches_recurrence(lens, l2norm):
    # without the in-kernel l2norm, smaller keys keep the recurrence bounded
    q, k, v, g, beta, state = _gdr_inputs(lens, key_scale=1.0 if l2norm else 0.25)
    want, want_state = recurrence(q, k, v, g, beta, _cu(lens), state, l2norm)
    out, final = gd.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), True, _cu(lens),
                                           False, l2norm)
    assert out.shape == v.shape and out.dtype == v.dtype
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


def test_chunk_final_state_is_the_float32_initial_state():
    # the kernel's ``initial_state.to(at::kFloat)``: SGLang's gathered states are
    # updated in place and returned as the final states
    lens = [3, 9]
    q, k, v, g, beta, state = _gdr_inputs(lens)
    _, want_state = recurrence(q, k, v, g, beta, _cu(lens), state, True)
    init = state.clone()
    _, final = gd.chunk_gated_delta_rule(q, k, v, g, beta, init, True, _cu(lens), False, True)
    assert final.data_ptr() == init.data_ptr()
    torch.testing.assert_close(init, want_state, atol=1e-5, rtol=1e-5)


def test_chunk_state_indices_read_and_write_pool_rows():
    # sgl-kernel 0.4.10 (SGLang 0.5.23): initial_state is the pool, rows by index
    lens = [4, 6, 2]
    q, k, v, g, beta, state = _gdr_inputs(lens, seed=3)
    pool = torch.randn(7, *state.shape[1:], generator=_gen(4))
    rows = torch.tensor([5, 1, 3], dtype=torch.int32)
    pool[rows.long()] = state
    before = pool.clone()
    want, want_state = recurrence(q, k, v, g, beta, _cu(lens), state, True)
    out, final = gd.chunk_gated_delta_rule(q, k, v, g, beta, pool, True, _cu(lens), False, True,
                                           rows)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[rows.long()], want_state, atol=1e-5, rtol=1e-5)
    untouched = [i for i in range(7) if i not in rows.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_chunk_continues_from_a_carried_state():
    # two calls (the second seeded with the first's final state) == one call
    q, k, v, g, beta, state = _gdr_inputs([100], seed=5)
    split = 70
    _, full = gd.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), True, _cu([100]),
                                        False, True)
    out_a, mid = gd.chunk_gated_delta_rule(q[:, :split], k[:, :split], v[:, :split],
                                           g[:, :split], beta[:, :split], state.clone(), True,
                                           _cu([split]), False, True)
    out_b, end = gd.chunk_gated_delta_rule(q[:, split:], k[:, split:], v[:, split:],
                                           g[:, split:], beta[:, split:], mid.clone(), True,
                                           _cu([100 - split]), False, True)
    out, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), True, _cu([100]),
                                       False, True)
    torch.testing.assert_close(torch.cat([out_a, out_b], 1), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, full, atol=1e-5, rtol=1e-5)


def test_chunk_refuses_what_the_kernel_refuses():
    q, k, v, g, beta, state = _gdr_inputs([3])
    with pytest.raises(RuntimeError, match="head first"):
        gd.chunk_gated_delta_rule(q, k, v, g, beta, state, True, _cu([3]), True, True)
    with pytest.raises(RuntimeError, match="float32 initial_state"):
        gd.chunk_gated_delta_rule(q, k, v, g, beta, state.bfloat16(), True, _cu([3]), False, True)


# ------------------------------------------------------------------ fused_gdn_gating


def test_gating_formula_shapes_and_dtypes():
    g0 = _gen(6)
    A_log = torch.randn(4, generator=g0)
    a = torch.randn(5, 4, generator=g0) * 10  # reaches softplus' linear branch (> 20)
    a[0, 0] = 30.0
    b = torch.randn(5, 4, generator=g0).bfloat16()
    dt_bias = torch.randn(4, generator=g0)
    g, beta = gd.fused_gdn_gating(A_log, a, b, dt_bias)
    assert g.shape == (1, 5, 4) and g.dtype == torch.float32
    assert beta.shape == (1, 5, 4) and beta.dtype == torch.bfloat16
    x = a + dt_bias
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g[0], -torch.exp(A_log) * softplus)
    torch.testing.assert_close(beta[0], torch.sigmoid(b.float()).bfloat16())


# ------------------------------------------------------------------ causal conv1d


def _conv_ref(xs, weight, bias, left, silu=True):
    """Depthwise causal conv of ``xs`` ([dim, L]) after ``left`` ([dim, W-1])."""
    dim, width = weight.shape
    full = torch.cat([left, xs], dim=-1)[None]
    out = F.conv1d(full, weight[:, None, :], bias, groups=dim)[0]
    return F.silu(out) if silu else out


def _conv_inputs(lens, dim=8, width=4, slots=6, seed=0):
    g = _gen(seed)
    x = torch.randn(sum(lens), dim, generator=g).t()  # the transpose SGLang passes
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(slots, dim, width - 1, generator=g)
    return x, weight, bias, states


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
def test_conv_varlen_matches_conv1d_and_updates_states(silu):
    lens = [5, 2, 1, 9]  # 2 and 1 are shorter than the window
    x, weight, bias, states = _conv_inputs(lens)
    rows = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, False])
    before = states.clone()
    out = gd.causal_conv1d_fwd(x, weight, bias, states, _cu(lens), rows, has_init, silu, -1, True)
    assert out.shape == x.shape and out.stride() == x.stride()  # x's transposed layout
    cu = _cu(lens)
    for i, n in enumerate(lens):
        s, e = int(cu[i]), int(cu[i + 1])
        left = before[rows[i]] if has_init[i] else torch.zeros(8, 3)
        torch.testing.assert_close(out[:, s:e], _conv_ref(x[:, s:e], weight, bias, left, silu))
        window = torch.cat([left, x[:, s:e]], dim=-1)
        assert torch.equal(states[rows[i]], window[:, -3:])  # the last width-1 inputs
    assert torch.equal(states[[1, 3]], before[[1, 3]])  # rows no sequence owns


def test_conv_batched_layout_and_no_state():
    x, weight, bias, _ = _conv_inputs([6, 6])
    xb = torch.stack([x[:, :6], x[:, 6:]]).transpose(1, 2).contiguous().transpose(1, 2)
    out = gd.causal_conv1d_fwd(xb, weight, None, None, None, None, None, True, -1, True)
    for i in range(2):
        torch.testing.assert_close(out[i], _conv_ref(xb[i], weight, None, torch.zeros(8, 3)))


def test_conv_refuses_what_the_kernel_refuses():
    x, weight, bias, states = _conv_inputs([4])
    args = (_cu([4]), torch.tensor([0], dtype=torch.int32), torch.tensor([False]), True, -1, True)
    with pytest.raises(RuntimeError, match="transposed"):
        gd.causal_conv1d_fwd(x.contiguous(), weight, bias, states, *args)
    with pytest.raises(RuntimeError, match="conv_states dtype"):
        gd.causal_conv1d_fwd(x, weight, bias, states.bfloat16(), *args)


def test_conv_update_continues_the_prefill():
    # prefill L tokens, then one decode token per sequence == prefill of L + 1 tokens
    lens = [5, 3]
    x, weight, bias, states = _conv_inputs([6, 4], seed=2)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    no_init = torch.tensor([False, False])
    full_states = states.clone()
    full = gd.causal_conv1d_fwd(x, weight, bias, full_states, _cu([6, 4]), rows, no_init, True,
                                -1, True)
    prefix = torch.cat([x[:, 0:5], x[:, 6:9]], dim=-1).t().contiguous().t()
    gd.causal_conv1d_fwd(prefix, weight, bias, states, _cu(lens), rows, no_init, True, -1, True)
    before = states.clone()
    last = torch.stack([x[:, 5], x[:, 9]]).contiguous()  # [batch, dim]
    out = gd.causal_conv1d_update(last, states, weight, bias, True, None, rows, -1, True)
    torch.testing.assert_close(out, torch.stack([full[:, 5], full[:, 9]]))
    assert torch.equal(states[rows.long()], full_states[rows.long()])
    assert torch.equal(states[[0, 2, 4, 5]], before[[0, 2, 4, 5]])


# ------------------------------------------------------------------ decode step


def test_decode_step_continues_the_chunked_prefill():
    lens = [4, 7]
    q, k, v, g, beta, state = _gdr_inputs([5, 8], seed=8)
    A_log = torch.randn(4, generator=_gen(9))
    dt_bias = torch.randn(4, generator=_gen(10))
    a = torch.randn(13, 4, generator=_gen(11))
    b = torch.randn(13, 4, generator=_gen(12))
    g_all, beta_all = gd.fused_gdn_gating(A_log, a, b, dt_bias)
    # the whole sequences at once
    want, want_state = recurrence(q, k, v, g_all, beta_all, _cu([5, 8]), state, True, eps=1e-6)
    # prefill all but the last token of each, then one decode step for both
    keep = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    last = [4, 12]
    pool = torch.randn(5, *state.shape[1:], generator=_gen(13))
    rows = torch.tensor([2, 4], dtype=torch.int32)
    pool[rows.long()] = state
    before = pool.clone()
    _, mid = gd.chunk_gated_delta_rule(q[:, keep], k[:, keep], v[:, keep], g_all[:, keep],
                                       beta_all[:, keep], state.clone(), True, _cu(lens), False,
                                       True, eps=1e-6)
    pool[rows.long()] = mid
    out = gd.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q[:, last], k[:, last], v[:, last], a[last], b[last], pool, rows,
        torch.arange(3, dtype=torch.int32), True)
    assert out.shape == (2, 1, 4, 6)
    torch.testing.assert_close(out[:, 0], want[0, last], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[rows.long()], want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])


# ------------------------------------------------------------------ installing


def test_registered_ops_are_these_functions():
    gd.register_ops()
    assert gd.register_ops() == []  # idempotent
    for name in gd.SCHEMAS:
        assert hasattr(torch.ops.sgl_kernel, name)
    lens = [3, 2]
    q, k, v, g, beta, state = _gdr_inputs(lens)
    want, _ = gd.chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), True, _cu(lens),
                                        False, True)
    out, _ = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(q, k, v, g, beta, state.clone(),
                                                             True, _cu(lens), False, True)
    assert torch.equal(out, want)
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # AMX probe stays off


# Run in the stand-ins' shared CPU engine process (conftest.py's ``engine_process``).
ENGINE_CHECK = """
import inspect, json, torch
from harness.standins.cpu_engine import install
install()
from harness.standins.cpu_kernels import gated_delta as gd
done = gd.install()
import sgl_kernel
from sgl_kernel.mamba import causal_conv1d_fn_cpu, chunk_gated_delta_rule_cpu
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 8, generator=g).t()
w = torch.randn(8, 4, generator=g)
states = torch.zeros(2, 8, 3)
cu = torch.tensor([0, 4, 6], dtype=torch.int32)
idx = torch.tensor([1, 0], dtype=torch.int32)
out = causal_conv1d_fn_cpu(x, w, None, "silu", states, torch.tensor([False, False]), idx, cu,
                           [4, 2])
want = gd.causal_conv1d_fwd(x, w, None, torch.zeros(2, 8, 3), cu, idx,
                            torch.tensor([False, False]), True, -1, True)
q = torch.randn(1, 6, 2, 4, generator=g); v = torch.randn(1, 6, 2, 4, generator=g)
gg = -torch.rand(1, 6, 2, generator=g); beta = torch.rand(1, 6, 2, generator=g)
init = torch.zeros(2, 2, 4, 4)
params = list(inspect.signature(chunk_gated_delta_rule_cpu).parameters)
extra = [idx] if "initial_state_indices" in params else []
o, last, h = chunk_gated_delta_rule_cpu(q, q, v, gg, beta, init, cu, False, True, *extra)
out = {"standin": bool(getattr(sgl_kernel, "__standin__", False)),
       "mamba": done["mamba"], "conv": torch.equal(out, want),
       "states": bool(states.abs().sum() > 0), "chunk": list(o.shape),
       "h": h is None, "indices": bool(extra)}
"""


@pytest.mark.xdist_group("engine-process")
def test_sglang_wrappers_reach_the_ops_in_a_cpu_engine_process(engine_process):
    """What a parity rank does: the CPU engine's sgl_kernel stand-in, then these ops and
    the installed sgl-kernel's own ``mamba.py`` wrappers as ``sgl_kernel.mamba``."""
    out = engine_process(__name__)
    if out["standin"]:
        assert out["mamba"] == "loaded"
    assert out["conv"] and out["states"] and out["h"]
    assert out["chunk"] == [1, 6, 2, 4]
