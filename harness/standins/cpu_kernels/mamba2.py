"""Mamba2 prefill on the CPU: ``causal_conv1d_fn`` (Triton) and ``mamba_chunk_scan_combined``.

``MambaMixer2.forward`` (``layers/attention/mamba/mamba.py``, the Mamba2 mixer of
granitemoehybrid and the other Mamba2 hybrids) runs an extend batch through two GPU ops:

* ``causal_conv1d_fn_triton`` (granitemoehybrid passes ``use_triton_causal_conv=True``):
  bound only under ``is_cuda()`` / ``is_npu()`` / ``is_xpu()`` (pin mamba.py 42-74, 0.5.23
  43-75), so on the CPU the name is unbound and the mixer raises NameError;
* ``mamba_chunk_scan_combined`` (pin ``layers/attention/mamba/ops/ssd_combined.py``,
  0.5.23 ``kernels/ops/mamba/triton_ops/ssd_combined.py``): Triton kernels whose launchers
  enter ``torch.get_device_module(device).device(index)``, which ``torch.cpu`` lacks
  (pin ssd_chunk_state.py 463: AttributeError), so they cannot run on the CPU, not even
  in Triton's interpreter.

This module has a pure-torch version of each, same arguments and the same outputs:
:func:`causal_conv1d_fn` returns a fresh ``(dim, tokens)`` tensor and updates
``conv_states[cache_indices[i]]`` in place with the last ``width - 1`` inputs of
sequence ``i`` (after its initial state); :func:`mamba_chunk_scan_combined` writes ``y``
into ``out`` in place and returns what its flags ask for: the per-chunk states (the
state entering each physical chunk, as the chunked kernels' state passing leaves it),
the final states, the per-sequence (varlen) final states and, on 0.5.23, the states at
tracked positions. Both compute the recurrence of the op's definition token by token in
float32 (the kernels' accumulation type) instead of the chunked algorithm: the same
values up to rounding. What the CPU path here does not implement (decode updates,
initial states without ``cu_seqlens`` and a sequence index) raises.

:func:`install` binds them in the mamba mixer's module (a family ``setup`` hook). Each
has a unit test against the op's definition (``tests/standins/test_cpu_kernels_mamba2.py``).

Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any, List, Optional

MODULE = "sglang.srt.layers.attention.mamba.mamba"
PAD_SLOT_ID = -1  # SGLang's PAD_SLOT_ID (ops/mamba_ssm.py at the pin, triton_ops on 0.5.23)

_ORIGINAL: dict[str, Any] = {}


# ------------------------------------------------------------------ causal conv1d


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu: List[int],
                     cache_indices=None, has_initial_state=None, activation: Optional[str] = "silu",
                     pad_slot_id: int = PAD_SLOT_ID, validate_data: bool = False, **kwargs):
    """SGLang's Triton ``causal_conv1d_fn`` (varlen, continuous batching).

    ``x``: ``(dim, tokens)``, the sequences packed left to right (``query_start_loc``,
    ``batch + 1`` offsets); ``weight``: ``(dim, width)``; ``conv_states``:
    ``(cache_lines, dim, >= width - 1)``, its first ``width - 1`` columns the state of
    a cache line. Sequence ``i`` (cache line ``cache_indices[i]``, or ``i``; skipped
    when it is ``pad_slot_id``) is convolved after its state when
    ``has_initial_state[i]``, else after zeros; its cache line then holds the last
    ``width - 1`` columns of ``[state, x_i]``. Returns the output, shaped as ``x``.
    """
    import torch

    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"causal_conv1d_fn (CPU stand-in): activation {activation!r}")
    if x.dim() != 2:
        raise NotImplementedError("causal_conv1d_fn (CPU stand-in): x must be (dim, tokens)")
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("causal_conv1d_fn (CPU stand-in): block_table")
    dim, width = weight.shape
    state_len = width - 1
    out = torch.zeros_like(x)
    starts = [int(v) for v in query_start_loc.tolist()]
    w = weight.float()
    for i in range(len(starts) - 1):
        start, end = starts[i], starts[i + 1]
        if end <= start:
            continue
        line = int(cache_indices[i]) if cache_indices is not None else i
        if line == pad_slot_id:
            continue
        if has_initial_state is not None and bool(has_initial_state[i]):
            left = conv_states[line, :, :state_len].float()
        else:
            left = x.new_zeros((dim, state_len), dtype=torch.float32)
        seq = torch.cat([left, x[:, start:end].float()], dim=1)  # (dim, state_len + n)
        n = end - start
        acc = sum(w[:, k:k + 1] * seq[:, k:k + n] for k in range(width))
        if bias is not None:
            acc = acc + bias.float()[:, None]
        if activation is not None:
            acc = torch.nn.functional.silu(acc)
        out[:, start:end] = acc.to(out.dtype)
        if conv_states is not None:
            conv_states[line, :, :state_len] = seq[:, -state_len:].to(conv_states.dtype)
    return out


# ------------------------------------------------------------------ SSD scan


def _softplus(x):
    import torch

    return torch.where(x <= 20.0, torch.nn.functional.softplus(x), x)


def _sequences(seqlen: int, b: int, seq_idx, cu_seqlens) -> list:
    """``(sequence id, start, end)`` of batch row ``b``."""
    if cu_seqlens is not None:
        bounds = [int(v) for v in cu_seqlens.tolist()]
        return [(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    if seq_idx is None:
        return [(b, 0, seqlen)]
    ids = seq_idx[b].tolist()
    out, start = [], 0
    for t in range(1, seqlen + 1):
        if t == seqlen or ids[t] != ids[t - 1]:
            out.append((int(ids[start]), start, t))
            start = t
    return out


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, chunk_indices=None,
                              chunk_offsets=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), out=None,
                              return_final_states=False, return_varlen_states=False,
                              return_intermediate_states=False, state_dtype=None,
                              return_track_states=False, track_seq_idx=None,
                              track_end_locs=None):
    """SGLang's ``mamba_chunk_scan_combined`` (Mamba2's SSD scan), pin and 0.5.23 arguments.

    Per head ``h`` (group ``g = h // (nheads / ngroups)``) and token ``t`` of a sequence:
    ``dt = clamp(softplus(dt + dt_bias))``, ``state = exp(dt * A[h]) * state + dt *
    outer(x_t, B_t[g])``, ``y_t = state @ C_t[g] + D[h] * x_t`` (times ``silu(z_t)``
    with ``z``), each sequence from its initial state (``initial_states[s]`` with
    ``cu_seqlens``, else zeros). ``y`` goes into ``out`` (in place). Returned, as the
    kernels' flags select: ``states`` ``(batch, nchunks, nheads, headdim, dstate)``, the
    state entering each physical chunk of ``chunk_size`` tokens (entry ``c > 0``: the
    state of the sequence owning token ``c * chunk_size - 1`` after it; entry 0:
    ``initial_states[0]`` or zeros), ``final_states`` (after the last token's
    sequence), ``varlen_states`` ``(num_sequences, ...)`` and ``track_states`` ``(1,
    len(track_end_locs), ...)``: the state of sequence ``track_seq_idx[i]`` after the
    tokens before ``track_end_locs[i]``.
    """
    import math

    import torch

    if not return_varlen_states:
        cu_seqlens = None
    elif cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    if cu_seqlens is not None and batch != 1:
        raise ValueError("passing cu_seqlens to get the varlen states is only supported "
                         "if batch dimension is 1")
    if initial_states is not None and cu_seqlens is None and seq_idx is not None:
        raise NotImplementedError("mamba_chunk_scan_combined (CPU stand-in): initial states "
                                  "with a sequence index but no cu_seqlens")
    out_dtype = state_dtype if state_dtype is not None else C.dtype
    heads_per_group = nheads // ngroups
    group = torch.arange(nheads) // heads_per_group

    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = _softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    A = A.float()
    if D is not None:
        D = D.float()
        D = D[:, None] if D.dim() == 1 else D  # (nheads, 1 or headdim)

    nchunks = math.ceil(seqlen / chunk_size)
    y = torch.empty(batch, seqlen, nheads, headdim, dtype=torch.float32)
    # after[b][t]: the state of token t's sequence after token t
    after = torch.empty(batch, seqlen, nheads, headdim, dstate, dtype=torch.float32)
    initial_of: dict = {}
    for b in range(batch):
        for s, start, end in _sequences(seqlen, b, seq_idx, cu_seqlens):
            if initial_states is None:
                state = torch.zeros(nheads, headdim, dstate, dtype=torch.float32)
            else:
                state = initial_states[s if cu_seqlens is not None else b].float().clone()
            initial_of[(b, s)] = state.clone()
            for t in range(start, end):
                xt = x[b, t].float()  # (nheads, headdim)
                bt = B[b, t].float()[group]  # (nheads, dstate)
                ct = C[b, t].float()[group]
                dtt = dt[b, t]  # (nheads,)
                state = (torch.exp(dtt * A)[:, None, None] * state
                         + dtt[:, None, None] * xt[:, :, None] * bt[:, None, :])
                after[b, t] = state
                yt = (state * ct[:, None, :]).sum(-1)
                if D is not None:
                    yt = yt + D * xt
                if z is not None:
                    yt = yt * torch.nn.functional.silu(z[b, t].float())
                y[b, t] = yt
    if out is None:
        out = torch.empty_like(x)
    out.copy_(y.to(out.dtype))

    states = torch.empty(batch, nchunks, nheads, headdim, dstate, dtype=torch.float32)
    for b in range(batch):
        if initial_states is None:
            states[b, 0] = 0.0
        else:
            states[b, 0] = initial_states[0 if cu_seqlens is not None else b].float()
        for c in range(1, nchunks):
            states[b, c] = after[b, c * chunk_size - 1]
    final_states = after[:, seqlen - 1].clone()
    states, final_states = states.to(out_dtype), final_states.to(out_dtype)

    rest = []
    if cu_seqlens is not None:
        seqs = _sequences(seqlen, 0, seq_idx, cu_seqlens)
        varlen = torch.stack([after[0, end - 1] if end > start else initial_of[(0, s)]
                              for s, start, end in seqs])
        rest.append(varlen.to(out_dtype))
        track = None
        if track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel():
            picked = []
            for s, loc in zip(track_seq_idx.tolist(), track_end_locs.tolist()):
                start = seqs[int(s)][1]
                picked.append(after[0, int(loc) - 1] if int(loc) > start
                              else initial_of[(0, int(s))])
            track = torch.stack(picked).unsqueeze(0).to(out_dtype)
        rest.append(track)

    if return_track_states:
        if not return_varlen_states:
            raise ValueError("return_track_states requires return_varlen_states "
                             "(cu_seqlens mode)")
        return states, rest[0], rest[1]
    if return_intermediate_states:
        if return_varlen_states:
            return (states, final_states, rest[0]) if return_final_states else (states, rest[0])
        return (states, final_states) if return_final_states else states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, rest[0]) if return_final_states else rest[0]


# ------------------------------------------------------------------ install


def install() -> None:
    """Bind both in the mamba mixer's module (idempotent): ``MambaMixer2.forward`` looks
    ``causal_conv1d_fn_triton`` and ``mamba_chunk_scan_combined`` up there at call time.
    A family ``setup`` hook; on the CPU only (a GPU keeps SGLang's kernels)."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return
    mixer = importlib.import_module(MODULE)
    for name, fn in (("causal_conv1d_fn_triton", causal_conv1d_fn),
                     ("mamba_chunk_scan_combined", mamba_chunk_scan_combined)):
        if getattr(mixer, name, None) is not fn:
            _ORIGINAL.setdefault(name, getattr(mixer, name, None))
            setattr(mixer, name, fn)
