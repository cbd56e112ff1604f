"""Real SGLang ``ForwardBatch`` objects and batch-level switches for the stand-in models."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

from harness.standins.kernels import _torch


def make_forward_batch(input_ids, mode: str = "extend", extend_seq_lens: Optional[List[int]] = None):
    """A real ``ForwardBatch`` with the fields the model and communicator read."""
    torch = _torch()
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    n = int(input_ids.shape[0])
    dev = input_ids.device
    forward_mode = {
        "extend": ForwardMode.EXTEND,
        "decode": ForwardMode.DECODE,
        "idle": ForwardMode.IDLE,
    }[mode]
    seq_lens_list = extend_seq_lens if extend_seq_lens is not None else ([n] if n else [])
    bs = len(seq_lens_list) if mode == "extend" else n
    seq_lens = torch.tensor(
        seq_lens_list if mode == "extend" else [1] * n, dtype=torch.int64, device=dev
    )
    fb = ForwardBatch(
        forward_mode=forward_mode,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=dev),
        seq_lens=seq_lens,
        out_cache_loc=torch.arange(n, dtype=torch.int64, device=dev),
        seq_lens_sum=int(seq_lens.sum()),
        positions=torch.arange(n, dtype=torch.int64, device=dev),
        capture_hidden_mode=CaptureHiddenMode.NULL,
    )
    if mode == "extend":
        fb.extend_seq_lens = seq_lens
        fb.extend_seq_lens_cpu = list(seq_lens_list)
        fb.extend_prefix_lens = torch.zeros_like(seq_lens)
        fb.extend_prefix_lens_cpu = [0] * bs
        fb.extend_num_tokens = n
    return fb


@contextlib.contextmanager
def attn_tp_input_scattered(enabled: bool = True) -> Iterator[None]:
    """Allow SGLang's attention-TP input scattering (``--enable-attn-tp-input-scattered``).

    SGLang's ``AttnTpContext.init_context`` allows it only on CUDA/NPU; this sets the
    resulting flag, and the real ``maybe_input_scattered`` / ``use_input_scattered``
    decide per batch as in ``DeepseekV2ForCausalLM.forward``.
    """
    from sglang.srt.layers.communicator import get_attn_tp_context

    ctx = get_attn_tp_context()
    old = ctx.allow_input_scattered
    ctx.allow_input_scattered = enabled
    try:
        yield
    finally:
        ctx.allow_input_scattered = old
