"""Peak memory of the aux-capture path: list + cat against the packer.

The capture path is what SGLang runs to collect K captures and hand them to the
logits processor as one [T, K * H] tensor:

* K calls of the real ``LayerCommunicator.prepare_attn_and_capture_last_layer_outputs``
  (its clone decision included), appending to the collector;
* the model's hand-off: ``finalize()`` for the packer, the list itself otherwise;
* the logits processor's ``pack_aux_hidden_states`` (``torch.cat`` for a list, the
  tensor itself when packed; for a list the release's own, since 0.5.23's series
  removes the list path: ``harness.memory.models.pack_for_draft``); the list is
  dropped after that, as when the model's forward returns.

The norm kernel's own scratch is not part of the capture path: on GPU the fused
add + RMSNorm allocates nothing, and on CPU its stand-in runs with tracking paused.
Peak bytes are over the baseline of tensors alive before the first capture
(hidden_states and residual): exact on CPU (live-storage tracking), the CUDA
allocator's peak on GPU.
"""

from __future__ import annotations

import functools
from typing import Any, Dict

_COMMS: Dict[Any, Any] = {}


def _communicator(hidden_size: int, dtype, device):
    """A real LayerCommunicator of a dense middle layer, with real RMSNorms."""
    key = (hidden_size, str(dtype), str(device))
    if key in _COMMS:
        return _COMMS[key]
    from sglang.srt.layers.communicator import LayerCommunicator, LayerScatterModes
    from sglang.srt.layers.layernorm import RMSNorm

    from harness.standins.kernels import cpu_rmsnorm_forward, has_real_kernels

    modes = LayerScatterModes.init_new(
        layer_id=1,
        num_layers=4,
        is_layer_sparse=False,
        is_previous_layer_sparse=False,
        is_next_layer_sparse=False,
    )
    norms = [RMSNorm(hidden_size).to(device=device, dtype=dtype) for _ in range(2)]
    if not has_real_kernels():
        from torch.utils._python_dispatch import _disable_current_modes

        def untracked(norm, *args, **kwargs):
            # The CPU stand-in's temporaries are kernel scratch: invisible on GPU.
            with _disable_current_modes():
                return cpu_rmsnorm_forward(norm, *args, **kwargs)

        for n in norms:
            n._forward_method = functools.partial(untracked, n)
    comm = LayerCommunicator(
        layer_scatter_modes=modes,
        input_layernorm=norms[0],
        post_attention_layernorm=norms[1],
        allow_reduce_scatter=True,
    )
    _COMMS[key] = comm
    return comm


class CopyCounter:
    """Counts bytes written by copying ops (clone, copy_, cat) under a dispatch mode."""

    COPY_OPS = ("aten.clone", "aten.copy_", "aten.cat", "aten._to_copy")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = str(func.overloadpacket)
                if name in CopyCounter.COPY_OPS:
                    t = out if not isinstance(out, (list, tuple)) else out[0]
                    counter.bytes += t.numel() * t.element_size()
                return out

        self.bytes = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def capture_path(path: str, tokens: int, hidden: int, k: int, dtype="float32", device="cpu"):
    """Runs the capture path; returns peak bytes over baseline and bytes copied."""
    import torch
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker

    from harness.memory.models import pack_for_draft
    from harness.memory.tracker import make_tracker
    from harness.standins.batch import make_forward_batch

    if path not in ("list", "packer"):
        raise ValueError(path)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    comm = _communicator(hidden, dtype, device)
    fb = make_forward_batch(torch.zeros(tokens, dtype=torch.int64, device=device))
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)

    def run():
        collector = AuxHiddenStatePacker(k) if path == "packer" else []
        h, r = hidden_states, residual
        for _ in range(k):
            h, r = comm.prepare_attn_and_capture_last_layer_outputs(
                h, r, fb, captured_last_layer_outputs=collector
            )
        handed_over = collector.finalize() if path == "packer" else collector
        del collector
        packed = pack_for_draft(handed_over)
        del handed_over
        return packed

    warmup = run if device != "cpu" else None
    counter = CopyCounter()
    with make_tracker(device, warmup=warmup) as tracker, counter:
        packed = run()
        held = tracker.current_bytes
    assert packed.shape == (tokens, k * hidden)
    capture_bytes = k * tokens * hidden * torch.tensor([], dtype=dtype).element_size()
    return {
        "path": path,
        "tokens": tokens,
        "hidden": hidden,
        "k": k,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "capture_bytes": capture_bytes,
        "peak_bytes": int(tracker.peak_bytes),
        "held_after_bytes": int(held),
        "copied_bytes": int(counter.bytes),
    }
