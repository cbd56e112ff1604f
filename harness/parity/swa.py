"""Hybrid sliding-window KV pools for the parity tier (Gemma 4).

SGLang's model runner gives a hybrid-SWA model (``ModelConfig.is_hybrid_swa``: Gemma 4,
GPT-OSS, Llama 4, ...) an ``SWAKVPool``: one MHA pool for the full-attention layers and
one for the sliding-window layers, which for Gemma 4 (``is_hybrid_swa_compress``) have
their own head count and head dim (``swa_num_key_value_heads``, ``swa_head_dim``: the
sliding layers' ``head_dim``, the full layers' ``global_head_dim``). One MHA pool of
one head dim, what :class:`harness.parity.runner.Requests` builds by default, cannot
hold both. :func:`pools` builds the pool the model runner builds
(``model_runner_kv_cache_mixin`` at the pin, ``kv_cache_configurator.
_build_hybrid_swa_kv_pool`` on 0.5.23), SGLang's SWA allocator over it (which registers
the full -> SWA slot mapping, as in the engine) and SGLang's ``torch_native`` backend.

The requests are a fresh pool's first, and every slot their forwards take is allocated
at once, so the allocator maps full slot ``i`` to SWA slot ``i``. That identity
matters: ``TorchNativeAttnBackend.forward_extend`` writes a sliding layer's K/V at the
translated SWA slots but reads them back through the untranslated ``req_to_token`` rows
(``k_cache[per_req_tokens]``, both bases), which is right only while the mapping is the
identity.

A family uses it with ``attention="harness.parity.swa:pools"``. Stdlib-only at import
time.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Sequence


def pools(model_config, tp: int, lens: Sequence[int]):
    """``(req_to_token_pool, SWAKVPool, TorchNativeAttnBackend)`` for ``model_config`` and
    requests of ``lens`` tokens each (the signature :class:`harness.parity.runner.Requests`
    calls)."""
    import torch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if not getattr(model_config, "is_hybrid_swa", False):
        raise ValueError(f"{model_config.hf_config.architectures}: not a hybrid-SWA model")
    total = sum(lens)
    size = total + 8
    text = model_config.hf_text_config
    kwargs = {}
    if getattr(model_config, "is_hybrid_swa_compress", False):
        # As the model runner passes them (sliding layers' own KV heads and head dims).
        kwargs = dict(
            swa_head_num=max(1, text.swa_num_key_value_heads // tp),
            swa_head_dim=text.swa_head_dim,
            swa_v_head_dim=text.swa_v_head_dim,
            v_head_dim=text.v_head_dim,
        )
    accepted = inspect.signature(SWAKVPool.__init__).parameters
    if "enable_kvcache_transpose" in accepted:  # the pin (0.5.23 dropped it)
        kwargs["enable_kvcache_transpose"] = False
    kv = SWAKVPool(
        size=size,
        size_swa=size,
        page_size=1,
        dtype=torch.float32,
        head_num=model_config.get_num_kv_heads(tp),
        head_dim=model_config.head_dim,
        swa_attention_layer_ids=model_config.swa_attention_layer_ids,
        full_attention_layer_ids=model_config.full_attention_layer_ids,
        device="cpu",
        **kwargs,
    )
    # SGLang's own SWA allocator registers the full -> SWA slot mapping; a fresh one
    # hands the requests the slots Requests writes (1..total in both pools).
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    allocator = SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=1,
                                          dtype=torch.float32, device="cpu", kvcache=kv,
                                          need_sort=False)
    slots = allocator.alloc(total)
    if slots is None or slots.tolist() != list(range(1, total + 1)):
        raise RuntimeError(f"the SWA allocator handed out {slots}, not slots 1..{total}")
    req_to_token = ReqToTokenPool(size=len(lens), max_context_len=max(lens) + 8, device="cpu",
                                  enable_memory_saver=False)
    backend = TorchNativeAttnBackend(
        SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv))
    return req_to_token, kv, backend
