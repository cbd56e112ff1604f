"""SGLang's triton attention backend as the model runner builds it, and the KV layer
count of its pools (:func:`harness.parity.runner.attention_backend` and ``_kv_pool``:
the families with ``attention="triton"``, and every family's verify batch).

The model runner:

* sizes the KV pools by ``end_layer - start_layer`` of the model, where a model without
  them (no PP) gets ``max(num_hidden_layers, num_attention_layers)`` (pin
  ``model_runner.py`` 717-732): LongCat-Flash has two attentions per decoder layer
  (``ModelConfig.num_attention_layers = 2 * num_hidden_layers``) with layer ids
  ``2 * i + j``;
* sets ``sliding_window_size`` from the model (``model.get_attention_sliding_window_size()``
  where the model has it, else ``ModelConfig.attention_chunk_size``; pin
  ``model_runner.py`` 1410-1423, 0.5.23 ``load_model_utils.resolve_sliding_window_size``),
  from which the triton backend sizes its window buffers at construction
  (``TritonAttnBackend.__init__``: ``window_kv_indptr``) before masking the layers whose
  ``RadixAttention.sliding_window_size`` is set.

:func:`num_kv_layers` and :func:`backend` do both, over SGLang's real ``ReqToTokenPool``
and ``MHATokenToKVPool`` / ``MLATokenToKVPool`` (the non-hybrid pools the engine uses
with ``--disable-hybrid-swa-memory``) or a family's own pools, its kernels interpreted on
the CPU (``TRITON_INTERPRET=1``, :data:`harness.parity.runner.ENV`). The triton backend
takes the attention sinks gpt_oss passes (``torch_native``'s ``forward_extend`` has no
``sinks`` argument), runs MLA's no-prefix prefill, and verifies a draft chain.

Stdlib-only at import time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional


def sliding_window_size(model, model_config) -> Optional[int]:
    """What the model runner sets ``sliding_window_size`` to for the loaded ``model``."""
    if hasattr(model, "get_attention_sliding_window_size"):
        return model.get_attention_sliding_window_size()
    if getattr(model_config, "is_hybrid_swa", False) and model_config.sliding_window_size:
        return model_config.sliding_window_size
    return getattr(model_config, "attention_chunk_size", None)


def num_kv_layers(model_config) -> int:
    """The model runner's KV layer count for a model without ``start_layer``/``end_layer``
    (the parity models are built without PP: the same count either way)."""
    return max(model_config.num_hidden_layers,
               getattr(model_config, "num_attention_layers", 0) or 0)


def kv_index_translator(req_to_token, kv):
    """0.5.23's model runner's one converter of KV ids over its pools, which it hands to
    its backends and binds every batch's plan to (``ForwardBatch.init_new``); None at
    the pin, which has none."""
    import importlib.util

    if importlib.util.find_spec("sglang.srt.mem_cache.kv_index_translator") is None:
        return None
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

    return KVIndexTranslator(req_to_token=req_to_token.req_to_token,
                             token_to_kv_pool_allocator=None, token_to_kv_pool=kv,
                             page_size=1, device="cpu", is_draft_worker=False)


def backend(model_config, req_to_token, kv, server_args, window: Optional[int], translator):
    """SGLang's ``TritonAttnBackend`` over these pools, from a model-runner namespace with
    the model's sliding window ``window`` (:func:`sliding_window_size`) and the pools'
    ``translator`` (:func:`kv_index_translator`); ``server_args``: what the pin's
    backend reads there (None on 0.5.23, which reads its runtime context)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # The model runner's hybrid-model properties the pin's backend reads (hybrid linear
    # pools: their layer 0 may hold no KV); 0.5.23 derives them from the model config.
    hybrid = dict(hybrid_gdn_config=None, kimi_linear_config=None, linear_attn_model_spec=None)
    if server_args is not None:
        from harness.parity.runner_view import runner_view

        view = runner_view(model_config, req_to_token, kv)
        hybrid = {name: getattr(view, name) for name in hybrid}
    runner = SimpleNamespace(
        device="cpu", gpu_id=0, model_config=model_config, server_args=server_args,
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, token_to_kv_pool_allocator=None,
        sliding_window_size=window, **hybrid, is_draft_worker=False,
        kv_cache_dtype=model_config.dtype, kv_index_translator=translator,
        decode_num_tokens_per_req=lambda: 1, spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    return TritonAttnBackend(runner)
