"""Pools and attention backend of a short-conv hybrid model (lfm2, lfm2_moe) for the parity tier.

LFM2's conv layers (``Lfm2ShortConv`` / ``Lfm2MoeShortConv``: a gated depthwise causal
conv of width ``conv_L_cache``) keep per-request conv windows in a ``MambaPool``
reached through a ``HybridReqToTokenPool`` (no SSM state: ``mamba2_cache_params`` has
``state_size`` 0), its attention layers have KV only in a ``HybridLinearKVPool``
(indexed by the full-attention layers alone). Both run behind a
``ShortConvHybridAttnBackend``: the attention layers through its full-attention
backend, the conv layers run their own kernels against the handle its
``ShortConvAttnBackend`` sidecar hands out (``conv_state_metadata``: the request's
slot, ``query_start_loc``, ``has_initial_state``), which the conv layer takes from the
forward context (``get_attn_backend()``). On 0.5.23 the model runner builds:

* the ``HybridReqToTokenPool`` when ``mamba2_config(model_config)`` (``configs/hybrid_arch.py``,
  which lists ``Lfm2Config`` and ``Lfm2MoeConfig``) is set
  (``mem_cache/kv_cache_configurator.py``, ``_build_hybrid_req_pool``; for an EAGLE
  target with ``speculative_num_draft_tokens``, which gives each slot the verify
  tape ``shortconv_target_verify`` asserts), and the ``HybridLinearKVPool``;
* the backend through ``attention_registry.attn_backend_wrapper``: for a
  ``mamba2_config`` that is a short-conv config, ``ShortConvHybridAttnBackend(full,
  ShortConvAttnBackend(runner), full_attention_layer_ids)``.

:func:`backend` builds the same with SGLang's own classes and its own wrapper (the
family's ``attention`` hook, :class:`harness.parity.runner.Requests`); the
full-attention part is the ``torch_native`` backend of the other families. As the
scheduler does for a new request, each request gets a fresh conv slot, zeroed.
:func:`setup` is the family's ``setup`` hook.

The conv kernels need no CPU version: off CUDA, ``layers/attention/mamba/causal_conv1d.py``
hands ``causal_conv1d_fn`` and ``causal_conv1d_update`` to SGLang's Triton kernels
(``_HAS_CONV1D_KERNEL = is_cuda()``, lines 26, 88, 160; the compiled kernels are
CUDA-only), and the verify batch calls the Triton ``causal_conv1d_update`` itself, with
the speculative tape (``shortconv_target_verify``, lfm2.py:227-259). The parity ranks
run Triton's interpreter (``TRITON_INTERPRET=1``, :data:`harness.parity.runner.ENV`),
so those kernels run as SGLang wrote them, conv windows updated in place. lfm2_moe's
fused short-conv kernels (``kernels/ops/mamba/lfm_short_conv.py``) are taken only for
CUDA tensors on sm90 (``can_use_fused_lfm_short_conv``, 230-248): never here.

Stdlib-only at import time.
"""

from __future__ import annotations

import os
from typing import Sequence

# Float32 parity runs: the conv window in the model's dtype. SGLang's conv state takes
# ``SGLANG_MAMBA_CONV_DTYPE`` (default bfloat16, for the released bfloat16 checkpoints:
# ``configs/mamba_utils.py`` ``mamba2_state_dtype``). With a bfloat16 window the float32
# lfm2 checkpoint's extend still matches transformers (4e-6), its decode and verify do
# not: the window rounds the conv input the next forward reads (final hidden states off
# by 9e-3 and 1.5e-2, |ref| about 4).
ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


def setup() -> None:
    """Per rank, before a short-conv hybrid is built: the conv window in float32, and
    the sgl-kernel CPU ops that ``attn_backend_wrapper``'s imports bind.

    For every mamba-ish model ``attn_backend_wrapper`` imports the KDA and GDN backends
    (``layers/attention/attention_registry.py:410-434``), which bind sgl-kernel CPU ops
    at module level: ``causal_conv1d_update_cpu`` from ``sgl_kernel.mamba``
    (``layers/attention/linear/kda_backend.py:39``) and
    ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu``
    (``layers/attention/linear/kernels/gdn_triton.py:32``). sgl-kernel's CPU build has
    them; the CUDA build the locks install has no CPU ops. Their pure-torch versions are
    installed as for the GDN families (:func:`harness.standins.cpu_kernels.gated_delta.install`);
    the short-conv path calls none of them."""
    os.environ.update(ENV)
    from harness.standins.cpu_kernels import gated_delta

    gated_delta.install()


def _short_conv_config(model_config):
    from sglang.srt.configs.hybrid_arch import mamba2_config

    cfg = mamba2_config(model_config)
    if cfg is None or cfg.mamba2_cache_params is None:
        raise ValueError(f"{type(model_config.hf_config).__name__} has no conv layers "
                         "(mamba2_config / mamba2_cache_params)")
    return cfg


def backend(model_config, tp: int, request_lengths: Sequence[int]):
    """``(req_to_token_pool, kv_pool, backend)`` for requests of ``request_lengths``
    tokens (rows ``1..`` of the req-to-token pool, each with a zeroed conv slot of its
    own), built as the model runner builds them for an EAGLE target (module
    docstring)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
        ShortConvHybridAttnBackend,
    )

    from harness.parity.hybrid import state_pool_backend

    # Each conv slot takes the verify tape of one draft chain (speculative_eagle_topk 1).
    req_to_token, kv, wrapped = state_pool_backend(
        model_config, _short_conv_config(model_config), tp, request_lengths,
        speculative_eagle_topk=1)
    if not isinstance(wrapped, ShortConvHybridAttnBackend):
        raise TypeError(f"attn_backend_wrapper gave {type(wrapped).__name__}, "
                        "not a ShortConvHybridAttnBackend")
    return req_to_token, kv, wrapped
