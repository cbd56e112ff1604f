"""SGLang's triton attention backend over pools sized the way the model runner sizes
them, for the parity families whose attention needs more than
:func:`harness.parity.runner.attention_backend` gives (a family's
``attention="harness.parity.triton_attention:triton"``).

The runner's builder creates its pools with ``ModelConfig.num_hidden_layers`` KV layers
and its backends from a model-runner namespace with ``sliding_window_size=None``, which
is right for the families without windows and with one attention per decoder layer.
The model runner itself:

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

:func:`triton` does both, over SGLang's real ``ReqToTokenPool`` and ``MHATokenToKVPool`` /
``MLATokenToKVPool`` (the non-hybrid pools the engine uses with
``--disable-hybrid-swa-memory``) and the triton backend, its kernels interpreted on the
CPU (``TRITON_INTERPRET=1``, :data:`harness.parity.runner.ENV`). The triton backend also
takes the attention sinks gpt_oss passes (``torch_native``'s ``forward_extend`` has no
``sinks`` argument) and runs MLA's no-prefix prefill.

Stdlib-only at import time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence


def sliding_window_size(model_config) -> Optional[int]:
    """What the model runner sets ``sliding_window_size`` to for this model."""
    from sglang.srt.model_loader.utils import get_model_architecture

    model_cls, _ = get_model_architecture(model_config)
    if hasattr(model_cls, "get_attention_sliding_window_size"):
        # The models' method reads only ``self.config`` (gpt_oss, gemma, ...).
        return model_cls.get_attention_sliding_window_size(
            SimpleNamespace(config=model_config.hf_config))
    if getattr(model_config, "is_hybrid_swa", False) and model_config.sliding_window_size:
        return model_config.sliding_window_size
    return getattr(model_config, "attention_chunk_size", None)


def num_kv_layers(model_config) -> int:
    """The model runner's KV layer count for a model without ``start_layer``/``end_layer``
    (the parity models are built without PP: the same count either way)."""
    return max(model_config.num_hidden_layers,
               getattr(model_config, "num_attention_layers", 0) or 0)


def _server_args():
    import importlib.util

    if importlib.util.find_spec("sglang.srt.runtime_context") is None:  # the pin
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    return None  # 0.5.23 reads its runtime context instead


def kv_pool(model_config, tp: int, size: int):
    """``MLATokenToKVPool`` or ``MHATokenToKVPool`` with :func:`num_kv_layers` layers."""
    import torch
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    layers = num_kv_layers(model_config)
    if model_config.attention_arch == AttentionArch.MLA:
        return MLATokenToKVPool(
            size=size, page_size=1, dtype=torch.float32,
            kv_lora_rank=model_config.kv_lora_rank,
            qk_rope_head_dim=model_config.qk_rope_head_dim,
            layer_num=layers, device="cpu", enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=size, page_size=1, dtype=torch.float32,
        head_num=model_config.get_num_kv_heads(tp), head_dim=model_config.head_dim,
        v_head_dim=getattr(model_config, "v_head_dim", None),
        layer_num=layers, device="cpu", enable_memory_saver=False,
    )


def triton(model_config, tp: int, prompt_lengths: Sequence[int]):
    """``(req_to_token_pool, kv_pool, backend)`` for an extend batch of ``prompt_lengths``
    (rows and slots ``1..`` are the requests'; ``runner.extend_batch`` fills them)."""
    import importlib.util

    import torch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    lens = list(prompt_lengths)
    req_to_token = ReqToTokenPool(size=len(lens), max_context_len=max(lens) + 8, device="cpu",
                                  enable_memory_saver=False)
    kv = kv_pool(model_config, tp, size=sum(lens) + 8)
    translator = None
    if importlib.util.find_spec("sglang.srt.mem_cache.kv_index_translator") is not None:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        # 0.5.23's model runner hands backends this one converter of KV ids.
        translator = KVIndexTranslator(req_to_token=req_to_token.req_to_token,
                                       token_to_kv_pool_allocator=None, token_to_kv_pool=kv,
                                       page_size=1, device="cpu", is_draft_worker=False)
    runner = SimpleNamespace(
        device="cpu", gpu_id=0, model_config=model_config, server_args=_server_args(),
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, token_to_kv_pool_allocator=None,
        sliding_window_size=sliding_window_size(model_config), hybrid_gdn_config=None,
        kimi_linear_config=None, linear_attn_model_spec=None, is_draft_worker=False,
        kv_cache_dtype=torch.float32, kv_index_translator=translator,
        decode_num_tokens_per_req=lambda: 1, spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    return req_to_token, kv, TritonAttnBackend(runner)
