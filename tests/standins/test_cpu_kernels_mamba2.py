"""The pure-torch Mamba2 prefill ops (harness.standins.cpu_kernels.mamba2) against their
definitions: the causal conv as ``torch.nn.functional.conv1d`` over each sequence's left
context and inputs, the SSD scan as the token-by-token state-space recurrence (float64),
its per-chunk states as the chunked kernels' state passing computes them; the state each
op updates in place (the cache lines it must write, the ones it must leave alone, the
``out`` it writes into); and, in a CPU-engine process, SGLang's own Triton kernels run by
Triton's interpreter, and :func:`install` binding both in the Mamba2 mixer's module."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from harness.standins.cpu_kernels import mamba2

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------ causal conv1d


def conv_reference(x, weight, bias, states, cu, lines, has_init, silu):
    """Per sequence: ``conv1d`` (depthwise, no padding) over ``[left, x_i]`` where
    ``left`` is the cache line's first ``width - 1`` columns or zeros; the line then
    holds the last ``width - 1`` columns of ``[left, x_i]``."""
    dim, width = weight.shape
    out = torch.zeros_like(x)
    new_states = states.clone()
    for i in range(cu.numel() - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        if lines[i] == mamba2.PAD_SLOT_ID:
            continue
        left = states[lines[i], :, :width - 1] if has_init[i] else torch.zeros(dim, width - 1)
        seq = torch.cat([left, x[:, s:e]], dim=1)
        y = F.conv1d(seq[None], weight[:, None, :], bias, groups=dim)[0]
        out[:, s:e] = F.silu(y) if silu else y
        new_states[lines[i], :, :width - 1] = seq[:, -(width - 1):]
    return out, new_states


def _conv_inputs(lens, dim=6, width=4, lines=8, seed=0):
    g = _gen(seed)
    tokens = sum(lens)
    x = torch.randn(tokens, dim, generator=g).t()  # channel-last, as the mixer passes it
    weight = torch.randn(dim, width, generator=g)
    bias = torch.randn(dim, generator=g)
    states = torch.randn(lines, dim, width - 1, generator=g)
    return x, weight, bias, states


@pytest.mark.parametrize("silu", [True, False])
def test_conv_matches_conv1d_and_updates_states(silu):
    lens = [7, 5, 2]  # the last one shorter than the state (width - 1 = 3)
    x, weight, bias, states = _conv_inputs(lens)
    x_before, states_before = x.clone(), states.clone()
    cu, lines = _cu(lens), torch.tensor([5, 1, 2], dtype=torch.int32)
    has_init = torch.tensor([False, True, True])
    want_out, want_states = conv_reference(x, weight, bias, states, cu, lines.tolist(),
                                           has_init.tolist(), silu)
    buf = states
    out = mamba2.causal_conv1d_fn(x, weight, bias, conv_states=states, query_start_loc=cu,
                                  seq_lens_cpu=lens, cache_indices=lines,
                                  has_initial_state=has_init,
                                  activation="silu" if silu else None)
    assert out.shape == x.shape and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before)
    assert states is buf  # updated in place
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    untouched = [i for i in range(states.shape[0]) if i not in lines.tolist()]
    assert torch.equal(states[untouched], states_before[untouched])


def test_conv_without_cache_indices_or_initial_state_uses_lines_in_order():
    lens = [3, 4]
    x, weight, bias, states = _conv_inputs(lens, lines=2, seed=1)
    cu = _cu(lens)
    want_out, want_states = conv_reference(x, weight, bias, states, cu, [0, 1], [False, False],
                                           True)
    out = mamba2.causal_conv1d_fn(x, weight, bias, states, cu, lens)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)


def test_conv_skips_pad_slots():
    lens = [4, 3]
    x, weight, bias, states = _conv_inputs(lens, seed=2)
    before = states.clone()
    cu = _cu(lens)
    lines = torch.tensor([mamba2.PAD_SLOT_ID, 3], dtype=torch.int32)
    out = mamba2.causal_conv1d_fn(x, weight, bias, states, cu, lens, cache_indices=lines,
                                  has_initial_state=torch.tensor([True, True]))
    want_out, want_states = conv_reference(x, weight, bias, before, cu, lines.tolist(),
                                           [True, True], True)
    torch.testing.assert_close(out[:, 4:], want_out[:, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    assert torch.equal(states[[0, 1, 2, 4, 5, 6, 7]], before[[0, 1, 2, 4, 5, 6, 7]])


def test_conv_refuses_what_it_does_not_implement():
    x, weight, bias, states = _conv_inputs([3])
    with pytest.raises(NotImplementedError, match="activation"):
        mamba2.causal_conv1d_fn(x, weight, bias, states, _cu([3]), [3], activation="gelu")
    with pytest.raises(NotImplementedError, match="block_table"):
        mamba2.causal_conv1d_fn(x, weight, bias, states, _cu([3]), [3],
                                block_table=torch.zeros(1, 1, dtype=torch.int32))


# ------------------------------------------------------------------ SSD scan


def _ssd_inputs(lens, nheads=4, headdim=3, ngroups=2, dstate=5, seed=0, d2=False, z=False):
    g = _gen(seed)
    T = sum(lens)
    return dict(
        x=torch.randn(1, T, nheads, headdim, generator=g),
        dt=torch.randn(1, T, nheads, generator=g),
        A=-torch.rand(nheads, generator=g) * 2,
        B=torch.randn(1, T, ngroups, dstate, generator=g),
        C=torch.randn(1, T, ngroups, dstate, generator=g),
        D=torch.randn(nheads, headdim, generator=g) if d2 else torch.randn(nheads, generator=g),
        dt_bias=torch.randn(nheads, generator=g) * 0.3,
        z=torch.randn(1, T, nheads, headdim, generator=g) if z else None,
    )


def _seq_idx(lens):
    return torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                   torch.tensor(lens)).unsqueeze(0)


def recurrence(inp, lens, initial=None, dt_limit=(0.0, float("inf"))):
    """Mamba2's state-space recurrence, one token at a time in float64: ``dt =
    clamp(softplus(dt + dt_bias))``; ``h = exp(dt A) h + dt x B^T``; ``y = h C + D x``
    (times ``silu(z)``). Returns ``y`` and the state after every token."""
    x, B, C = (inp[k].double() for k in ("x", "B", "C"))
    dt = F.softplus(inp["dt"].double() + inp["dt_bias"].double()).clamp(*dt_limit)
    A, D = inp["A"].double(), inp["D"].double()
    nheads, headdim = x.shape[2], x.shape[3]
    rep = nheads // B.shape[2]
    y = torch.zeros_like(x)
    after = torch.zeros(x.shape[1], nheads, headdim, B.shape[3], dtype=torch.float64)
    cu = _cu(lens).tolist()
    for s in range(len(lens)):
        h = (torch.zeros(nheads, headdim, B.shape[3], dtype=torch.float64) if initial is None
             else initial[s].double().clone())
        for t in range(cu[s], cu[s + 1]):
            Bt = B[0, t].repeat_interleave(rep, 0)
            Ct = C[0, t].repeat_interleave(rep, 0)
            h = torch.exp(dt[0, t] * A)[:, None, None] * h + torch.einsum(
                "h,hp,hn->hpn", dt[0, t], x[0, t], Bt)
            after[t] = h
            yt = torch.einsum("hpn,hn->hp", h, Ct)
            yt = yt + (D[:, None] if D.dim() == 1 else D) * x[0, t]
            if inp["z"] is not None:
                yt = yt * F.silu(inp["z"][0, t].double())
            y[0, t] = yt
    return y, after


def chunked_states(inp, lens, chunk, initial=None):
    """The per-chunk states as the chunked kernels compute them (float64): each chunk's
    own state from the tokens of the sequence that owns its last token, decayed to the
    chunk's end; then state passing: a chunk carries the previous chunk's state (decayed
    over the chunk) when the same sequence owns both ends, else starts from that
    sequence's initial state (decayed from where it starts) or zeros. Entry 0 is
    ``initial[0]`` or zeros; returns (states entering each chunk, final state)."""
    x, B = inp["x"].double(), inp["B"].double()
    dt = F.softplus(inp["dt"].double() + inp["dt_bias"].double())
    dA = dt * inp["A"].double()  # (1, T, H)
    nheads, rep = x.shape[2], x.shape[2] // B.shape[2]
    T = x.shape[1]
    owner = _seq_idx(lens)[0].tolist()
    starts = _cu(lens).tolist()
    nchunks = -(-T // chunk)
    zeros = torch.zeros(nheads, x.shape[3], B.shape[3], dtype=torch.float64)
    entering = [zeros.clone() if initial is None else initial[0].double().clone()]
    state, prev_owner = entering[0], None if initial is not None else 0
    for c in range(nchunks):
        lo, hi = c * chunk, min((c + 1) * chunk, T)
        s = owner[hi - 1]
        own = zeros.clone()
        for t in range(lo, hi):
            if owner[t] == s:
                decay = torch.exp(dA[0, t + 1:hi].sum(0))
                own += (decay * dt[0, t])[:, None, None] * torch.einsum(
                    "hp,hn->hpn", x[0, t], B[0, t].repeat_interleave(rep, 0))
        if s == prev_owner:
            state = torch.exp(dA[0, lo:hi].sum(0))[:, None, None] * state + own
        elif initial is not None:
            first = max(lo, starts[s])
            state = torch.exp(dA[0, first:hi].sum(0))[:, None, None] * initial[s].double() + own
        else:
            state = own
        prev_owner = s
        entering.append(state)
    return torch.stack(entering[:-1])[None], entering[-1][None]


SCAN_CASES = [  # lens, chunk, initial states, 2-D D, z
    ([7, 5], 4, False, False, False),
    ([7, 5, 3], 4, True, True, False),
    ([6, 1, 4], 256, False, False, True),
    ([9], 2, True, False, False),
]


@pytest.mark.parametrize("lens, chunk, init, d2, z", SCAN_CASES)
def test_scan_matches_recurrence_and_chunked_states(lens, chunk, init, d2, z):
    inp = _ssd_inputs(lens, d2=d2, z=z, seed=len(lens) + chunk)
    initial = torch.randn(len(lens), 4, 3, 5, generator=_gen(9)) * 0.5 if init else None
    out = torch.full_like(inp["x"], float("nan"))
    buf = out
    states, final, varlen = mamba2.mamba_chunk_scan_combined(
        chunk_size=chunk, seq_idx=_seq_idx(lens), cu_seqlens=_cu(lens),
        initial_states=initial, dt_softplus=True, out=out, return_final_states=True,
        return_varlen_states=True, return_intermediate_states=True, **inp)
    want_y, after = recurrence(inp, lens, initial)
    assert out is buf
    torch.testing.assert_close(out.double(), want_y, rtol=1e-5, atol=1e-5)
    ends = [e - 1 for e in _cu(lens).tolist()[1:]]
    torch.testing.assert_close(varlen.double(), after[ends], rtol=1e-5, atol=1e-5)
    want_states, want_final = chunked_states(inp, lens, chunk, initial)
    assert states.shape == (1, -(-sum(lens) // chunk), 4, 3, 5)
    torch.testing.assert_close(states.double(), want_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), want_final, rtol=1e-5, atol=1e-5)


def test_scan_return_conventions():
    lens = [5, 4]
    inp = _ssd_inputs(lens, seed=3)
    common = dict(chunk_size=4, seq_idx=_seq_idx(lens), cu_seqlens=_cu(lens),
                  dt_softplus=True, **inp)

    def run(**flags):
        return mamba2.mamba_chunk_scan_combined(out=torch.empty_like(inp["x"]), **common, **flags)

    full = run(return_final_states=True, return_varlen_states=True,
               return_intermediate_states=True)
    states, final, varlen = full
    assert run() is None
    assert torch.equal(run(return_final_states=True), final)
    assert torch.equal(run(return_varlen_states=True), varlen)
    got = run(return_final_states=True, return_varlen_states=True)
    assert torch.equal(got[0], final) and torch.equal(got[1], varlen)
    got = run(return_intermediate_states=True)
    assert torch.equal(got, states)
    got = run(return_intermediate_states=True, return_varlen_states=True)
    assert torch.equal(got[0], states) and torch.equal(got[1], varlen)
    got = run(return_intermediate_states=True, return_final_states=True)
    assert torch.equal(got[0], states) and torch.equal(got[1], final)
    # 0.5.23: states, varlen states, track states (None when nothing is tracked)
    got = run(return_varlen_states=True, return_track_states=True)
    assert torch.equal(got[0], states) and torch.equal(got[1], varlen) and got[2] is None
    with pytest.raises(ValueError):
        run(return_track_states=True)


def test_scan_track_states_are_states_before_the_locations():
    lens = [6, 5]
    inp = _ssd_inputs(lens, seed=4)
    initial = torch.randn(2, 4, 3, 5, generator=_gen(5))
    _, _, track = mamba2.mamba_chunk_scan_combined(
        chunk_size=4, seq_idx=_seq_idx(lens), cu_seqlens=_cu(lens), initial_states=initial,
        dt_softplus=True, out=torch.empty_like(inp["x"]), return_varlen_states=True,
        return_track_states=True, track_seq_idx=torch.tensor([0, 1, 1]),
        track_end_locs=torch.tensor([4, 6, 9]), **inp)
    _, after = recurrence(inp, lens, initial)
    want = torch.stack([after[3], initial[1].double(), after[8]])[None]
    torch.testing.assert_close(track.double(), want, rtol=1e-5, atol=1e-5)


def test_scan_dt_softplus_threshold_and_limit():
    lens = [4]
    inp = _ssd_inputs(lens, seed=6)
    inp["dt"] = torch.tensor([[[25.0, -3.0, 0.5, 1.0]] * 4])  # > 20: softplus is identity
    inp["dt_bias"] = torch.zeros(4)
    inp["A"] = -torch.full((4,), 1e-3)
    limit = (0.1, 2.0)
    out = torch.empty_like(inp["x"])
    mamba2.mamba_chunk_scan_combined(chunk_size=4, dt_softplus=True, dt_limit=limit, out=out,
                                     **inp)
    want, _ = recurrence(inp, lens, dt_limit=limit)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_scan_state_dtype_and_batch_rows_without_cu_seqlens():
    lens = [5]
    inp = _ssd_inputs(lens, seed=7)
    batched = {k: (torch.cat([v, v.flip(1)]) if k in ("x", "dt", "B", "C") else v)
               for k, v in inp.items()}
    out = torch.empty_like(batched["x"])
    final = mamba2.mamba_chunk_scan_combined(chunk_size=2, dt_softplus=True, out=out,
                                             return_final_states=True,
                                             state_dtype=torch.float64, **batched)
    assert final.dtype == torch.float64 and final.shape == (2, 4, 3, 5)
    for b in range(2):
        row = {k: (v[b:b + 1] if k in ("x", "dt", "B", "C") else v) for k, v in batched.items()}
        want, after = recurrence(row, lens)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[b], after[-1], rtol=1e-5, atol=1e-5)


def test_scan_refuses_what_it_does_not_implement():
    lens = [3, 2]
    inp = _ssd_inputs(lens)
    with pytest.raises(NotImplementedError, match="initial states"):
        mamba2.mamba_chunk_scan_combined(chunk_size=4, seq_idx=_seq_idx(lens),
                                         initial_states=torch.zeros(1, 4, 3, 5),
                                         out=torch.empty_like(inp["x"]), **inp)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba2.mamba_chunk_scan_combined(chunk_size=4, return_varlen_states=True,
                                         out=torch.empty_like(inp["x"]), **inp)


# ------------------------------------------------------------------ SGLang's own kernels

# Run in the stand-ins' shared CPU engine process (conftest.py's ``engine_process``):
# SGLang's CPU engine mode, TRITON_INTERPRET=1 before triton is imported. Last there: it
# replaces two GPU-only hooks of torch and Triton for its own kernels.
ENGINE_CHECK = textwrap.dedent(
    """
    import contextlib, importlib, json, sys
    from harness.standins.cpu_engine import install
    install()
    import torch
    from triton.runtime import autotuner
    from harness.standins.cpu_kernels import mamba2

    # The launchers enter torch.get_device_module(device).device(index), which torch.cpu
    # lacks; newer Triton autotuners benchmark through a GPU driver. Neither changes
    # what a kernel computes.
    torch.cpu.device = lambda index=None: contextlib.nullcontext()
    autotuner.Autotuner.do_bench = property(
        lambda self: lambda fn, quantiles=None: [1.0, 1.0, 1.0])

    def first(*names):
        for name in names:
            try:
                return importlib.import_module(name)
            except ImportError:
                pass
        raise ImportError(names)

    conv = first("sglang.kernels.ops.mamba.causal_conv1d_triton",
                 "sglang.srt.layers.attention.mamba.causal_conv1d_triton")
    ssd = first("sglang.kernels.ops.mamba.triton_ops.ssd_combined",
                "sglang.srt.layers.attention.mamba.ops.ssd_combined")
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    g = torch.Generator().manual_seed(0)
    report = {}
    lens = [7, 5, 2]
    cu = torch.tensor([0, 7, 12, 14], dtype=torch.int32)
    x = torch.randn(14, 24, generator=g).t()
    w, bias = torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    states = torch.randn(6, 24, 3, generator=g)
    lines = torch.tensor([4, 0, 2], dtype=torch.int32)
    has_init = torch.tensor([False, True, True])
    kw = dict(query_start_loc=cu, seq_lens_cpu=lens, cache_indices=lines,
              has_initial_state=has_init, activation="silu")
    s_triton, s_cpu = states.clone(), states.clone()
    o_triton = conv.causal_conv1d_fn(x, w, bias, s_triton, **kw)
    o_cpu = mamba2.causal_conv1d_fn(x, w, bias, s_cpu, **kw)
    report["conv_out"] = float((o_triton - o_cpu).abs().max())
    report["conv_states"] = float((s_triton - s_cpu).abs().max())

    lens = [7, 5, 3]
    T, H, P, G, N = 15, 4, 8, 2, 16
    cu = torch.tensor([0, 7, 12, 15], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32),
                                      torch.tensor(lens)).unsqueeze(0)
    inp = dict(x=torch.randn(1, T, H, P, generator=g), dt=torch.randn(1, T, H, generator=g),
               A=-torch.rand(H, generator=g) * 2, B=torch.randn(1, T, G, N, generator=g),
               C=torch.randn(1, T, G, N, generator=g), D=torch.randn(H, generator=g),
               dt_bias=torch.randn(H, generator=g) * 0.3)
    # chunks of 4 straddle the sequences; initial states enter mid-chunk (chunk offsets)
    ci, co = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(cu, 4, T)
    kw = dict(chunk_size=4, seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
              initial_states=torch.randn(3, H, P, N, generator=g) * 0.5, chunk_indices=ci,
              chunk_offsets=co, return_varlen_states=True, return_final_states=True,
              return_intermediate_states=True, **inp)
    out_triton, out_cpu = torch.zeros(1, T, H, P), torch.zeros(1, T, H, P)
    got_triton = ssd.mamba_chunk_scan_combined(out=out_triton, **kw)
    got_cpu = mamba2.mamba_chunk_scan_combined(out=out_cpu, **kw)
    report["ssd_out"] = float((out_triton - out_cpu).abs().max())
    for name, a, b in zip(("states", "final", "varlen"), got_triton, got_cpu):
        report[f"ssd_{name}"] = float((a - b).abs().max())

    mixer = importlib.import_module(mamba2.MODULE)
    mamba2.install()
    mamba2.install()
    report["bound"] = (mixer.causal_conv1d_fn_triton is mamba2.causal_conv1d_fn
                       and mixer.mamba_chunk_scan_combined is mamba2.mamba_chunk_scan_combined)
    out = report
    """
)
ENGINE_CHECK_ORDER = 9


@pytest.mark.xdist_group("engine-process")
def test_matches_sglang_triton_kernels_and_installs_in_a_cpu_engine_process(engine_process):
    """SGLang's Triton ``causal_conv1d_fn`` and ``mamba_chunk_scan_combined`` of the active
    base, run by Triton's interpreter on the same inputs (conv: a short sequence, cache
    lines out of order; SSD: chunks that straddle sequences, initial states with chunk
    offsets), give what the stand-ins give; then :func:`install` binds both where
    ``MambaMixer2.forward`` looks them up."""
    report = dict(engine_process(__name__))
    assert report.pop("bound") is True
    for name, diff in report.items():
        assert diff <= 5e-5, f"{name}: max abs diff {diff:.3g} against SGLang's Triton kernel"
