"""Pools and attention backend of a Mamba2 hybrid model (granitemoehybrid) for the parity tier.

A Mamba2 hybrid model needs more than a KV pool: its mamba layers keep per-request conv
and SSM states in a ``MambaPool`` reached through a ``HybridReqToTokenPool``, its
attention layers have KV only in a ``HybridLinearKVPool`` (indexed by the full-attention
layers alone), and both kinds of layer go through a ``HybridLinearAttnBackend``: the
mamba layers take its ``linear_attn_backend`` (a ``Mamba2AttnBackend``) from the forward
context (granitemoehybrid.py asserts both types), the attention layers its full-attention
backend (``torch_native`` here). :func:`backend` builds all of them as the model runner
does (``model_runner_kv_cache_mixin``: ``HybridReqToTokenPool`` /
``HybridLinearKVPool`` when ``ModelRunner.mamba2_config`` is set;
``attention_registry.attn_backend_wrapper``: ``Mamba2AttnBackend`` wrapped with the
full-attention backend and ``full_attention_layer_ids``), from SGLang's own classes,
on both bases. It is the ``attention`` hook of the family
(:class:`harness.parity.runner.Requests`); :func:`setup` is its ``setup`` hook.

Stdlib-only at import time.
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace
from typing import Any, Sequence


def setup() -> None:
    """Per rank, before a Mamba2 hybrid is built: the CPU versions of the mixer's two GPU
    kernels (:mod:`harness.standins.cpu_kernels.mamba2`), and the engine's (GPU) path of
    the mixer's sharded weight loader.

    ``mamba_v2_sharded_weight_loader`` (``layers/attention/mamba/mamba.py``, pin 82-186,
    0.5.23 83-187) has a CPU-only branch (``if is_cpu()``, pin 99-113 and 147-170, the
    same lines + 1 on 0.5.23) written for qwen3-next's odd TP sizes: whenever the
    checkpoint tensor is shorter than the sharded layout's full size it "pads" it by
    proportions. With ``mamba_n_groups == 1`` (every released Granite-4.0-H, NemotronH
    and Falcon-H1 checkpoint) at TP > 1 the layout is longer by design (the single
    group is replicated to every head shard), so the branch asserts ("Padding the loaded
    weight failed due to sizes are not divisible cleanly from [106, 26, 26] to 160" for
    the tiny checkpoint's conv1d at TP 2). That is a bug of SGLang's CPU engine, outside
    the capture path; the GPU engine never takes the branch. ``is_cpu`` is read only in
    that loader (both bases), so it answers False there and the loader runs the
    engine's own GPU code (plain slicing of CPU tensors)."""
    import importlib

    from harness.standins.cpu_kernels import mamba2

    mamba2.install()
    mixer = importlib.import_module(mamba2.MODULE)
    if getattr(mixer, "is_cpu", None) is not _never_cpu:
        mixer.is_cpu = _never_cpu


def _never_cpu() -> bool:
    return False


def _kwargs_for(fn, **candidates: Any) -> dict:
    """The ``candidates`` that ``fn`` takes (the two bases' constructors differ)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params}


def _server_args():
    if importlib.util.find_spec("sglang.srt.runtime_context") is None:  # the pin
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    from sglang.srt.runtime_context import get_context

    return get_context().server_args


def backend(model_config, tp: int, request_lengths: Sequence[int]):
    """``(req_to_token_pool, kv_pool, backend)`` for requests of ``request_lengths``
    tokens (in rows ``1..``, as the model runner's pools number them), the hybrid
    model's mamba states allocated for those rows, as the model runner builds them for
    an EAGLE target (the verify chain's intermediate states where the base can hold them
    on the CPU: :func:`harness.parity.hybrid.spec_draft_tokens`)."""
    import torch
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
        HybridLinearAttnBackend,
        Mamba2AttnBackend,
    )
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    from harness.parity.hybrid import spec_draft_tokens

    config = model_config.hf_config
    cache_params = config.mamba2_cache_params  # sharded by the attention-TP size
    bs, total = len(request_lengths), sum(request_lengths)
    req_to_token = HybridReqToTokenPool(**_kwargs_for(
        HybridReqToTokenPool.__init__,
        size=bs, mamba_size=bs, mamba_spec_state_size=bs,
        max_context_len=max(request_lengths) + 8, device="cpu", enable_memory_saver=False,
        cache_params=cache_params, mamba_layer_ids=list(cache_params.layers),
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=spec_draft_tokens(),
        enable_overlap_schedule=False, start_layer=0,
    ))
    # What HybridReqToTokenPool.alloc does for new requests: a mamba slot per request
    # row (the scheduler's rows 1..bs; row 0 is the padding row).
    slots = req_to_token.mamba_allocator.alloc(bs)
    req_to_token.req_index_to_mamba_index_mapping[1:bs + 1] = torch.as_tensor(
        slots, dtype=torch.int32)
    kv = HybridLinearKVPool(**_kwargs_for(
        HybridLinearKVPool.__init__,
        size=total + 8, dtype=torch.float32, page_size=1,
        head_num=model_config.get_num_kv_heads(tp), head_dim=model_config.head_dim,
        full_attention_layer_ids=list(config.full_attention_layer_ids),
        enable_kvcache_transpose=False, device="cpu",
        mamba_pool=req_to_token.mamba_pool, enable_memory_saver=False,
        enable_kv_cache_copy=False, use_mla=False, start_layer=0,
    ))
    full = TorchNativeAttnBackend(
        SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv))
    runner = SimpleNamespace(
        device="cpu", server_args=_server_args(), is_draft_worker=False,
        model_config=model_config, mamba2_config=config,
        req_to_token_pool=req_to_token, token_to_kv_pool=kv,
    )
    linear = Mamba2AttnBackend(runner)
    if not hasattr(full, "kv_index_translator"):  # 0.5.23's wrapper reads it
        full.kv_index_translator = None
    return req_to_token, kv, HybridLinearAttnBackend(
        full, linear, list(config.full_attention_layer_ids))
