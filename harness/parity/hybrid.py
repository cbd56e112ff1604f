"""Hybrid Gated-DeltaNet models in the parity tier: their pools and attention backend.

SGLang runs a hybrid GDN model (qwen3_next, qwen3_5 and its MoE variant) over two
kinds of state: a KV cache for its few full-attention layers and per-request
recurrent state (a causal-conv window and an SSM matrix) for its Gated DeltaNet
layers. The model runner builds, for a ``hybrid_gdn_config`` model:

* a ``HybridReqToTokenPool`` (``ReqToTokenPool`` + a ``MambaPool`` shaped by the text
  config's ``mamba2_cache_params``, one slot per request, and its slot allocator):
  the pin's ``model_runner_kv_cache_mixin.py`` and 0.5.23's
  ``mem_cache/kv_cache_configurator.py`` (``_build_hybrid_req_pool``);
* a ``HybridLinearKVPool`` over the full-attention layers only;
* its attention backend through ``attention_registry.attn_backend_wrapper``:
  ``HybridLinearAttnBackend(full_attn_backend, GDNAttnBackend(runner),
  full_attention_layer_ids)``.

:func:`gdn_backend` builds the same three with SGLang's own classes and its own
wrapper (a family's ``attention="harness.parity.hybrid:gdn_backend"``, see
``harness.parity.runner.Requests``), the full-attention part being the
``torch_native`` backend of the other families. As the scheduler does for a new
request, each request of the batch gets a fresh mamba slot, zeroed (the deferred
``mamba_clear_indices`` of a real batch). The GDN backend's CPU path, and 0.5.23's
qwen3_5.py, call sgl-kernel CPU ops, which the installed (CUDA) sgl-kernel lacks:
:func:`setup` (a family's ``setup`` hook) installs their pure-torch versions
(:mod:`harness.standins.cpu_kernels.gated_delta`, :mod:`harness.standins.cpu_kernels.qwen3_5`)
and keeps the conv-window state in the model's float32 (``SGLANG_MAMBA_CONV_DTYPE``; its
default, bfloat16, matches a bfloat16 model, as sgl-kernel's conv op requires).

Stdlib-only at import time.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Sequence

from harness.parity.runner_view import on_0_5_23 as _on_0_5_23
from harness.parity.runner_view import runner_view

# Float32 parity runs: the conv window in the activations' dtype, as the conv op checks.
ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


def setup() -> dict:
    """A hybrid GDN family's ``setup`` hook (once per rank, before the model is built)."""
    os.environ.update(ENV)
    from harness.standins.cpu_kernels import gated_delta, qwen3_5

    _device_module_without_a_driver()
    _sm_count_on_the_cpu()
    _hub_offline()
    done = gated_delta.install()
    done["ops"] += qwen3_5.install()
    return done


def _device_module_without_a_driver() -> None:
    """``torch.get_device_module()`` (no device) on a machine without a GPU driver: the CPU.

    The GDN layers place their gated norm's weight on
    ``torch.get_device_module().current_device()`` (0.5.23 qwen3_next.py:235/252; the
    pin's qwen3_next.py:191/208 and qwen3_5.py:258). torch 2.14 answers the *compiled*
    accelerator there (``torch._C._accelerator_getAccelerator()``), so with the CUDA
    wheel the locks install it returns ``torch.cuda`` on a driverless machine and
    ``current_device()`` raises "Found no NVIDIA driver"; torch 2.11 (the pin's) and a
    CPU build of torch, which SGLang's CPU engine installs, return ``torch.cpu``. Only
    the no-argument call without a usable CUDA device is redirected; with a GPU, or
    with an explicit device, nothing changes."""
    import torch

    original = torch.get_device_module
    if getattr(original, "_auxcap_cpu_fallback", False):
        return

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device)

    get_device_module._auxcap_cpu_fallback = True
    get_device_module.__wrapped__ = original
    torch.get_device_module = get_device_module


def _build(cls, **kwargs: Any):
    """``cls(**kwargs)``, leaving out the keywords this base's constructor does not take
    (the pin's ``HybridLinearKVPool`` has ``enable_kvcache_transpose``, 0.5.23's not)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls(**kwargs)
    return cls(**{k: v for k, v in kwargs.items() if k in params})


def _hub_offline() -> None:
    """No Hub lookups from a parity rank.

    0.5.23's ``Qwen3_5ForConditionalGeneration.__init__`` looks for a Clef checkpoint's
    ``joint_head_config.json`` under the runtime context's model path
    (qwen3_5.py:2400-2402, ``load_joint_head_config``: transformers' ``cached_file``).
    The harness publishes SGLang's placeholder path ``dummy`` there, so the lookup goes
    to the Hub repo "dummy" and, with no network, retries for about 30 s per rank.
    Nothing in a parity rank is downloaded (checkpoints are local directories): offline
    mode answers "no such file" at once. Set in ``huggingface_hub.constants``, which
    ``is_offline_mode()`` reads at each call, and in the environment for children."""
    import importlib

    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        constants = importlib.import_module("huggingface_hub.constants")
    except ImportError:
        return
    constants.HF_HUB_OFFLINE = True


def _sm_count_on_the_cpu() -> None:
    """The gated RMSNorm's Triton path sizes its blocks by the CUDA SM count.

    The GDN layers' output norm (``RMSNormGated``, the FLA ``layernorm_gated`` module)
    runs a Triton kernel on the CPU unless sgl-kernel's AMX build is there; under
    ``TRITON_INTERPRET`` it runs as written. To pick rows per block it asks
    ``_get_sm_count(x.device)``, which is ``torch.cuda.get_device_properties`` (0.5.23
    ``kernels/ops/attention/fla/layernorm_gated.py:212-231``, whenever the prefill graph
    backend is not piecewise; the pin takes a constant there with its default server
    args). On the CPU that raises. Each row is normalised on its own, so the block size
    changes nothing in the result: a CPU device gets the process's thread count."""
    import importlib

    import torch

    for name in ("sglang.kernels.ops.attention.fla.layernorm_gated",  # 0.5.23
                 "sglang.srt.layers.attention.fla.layernorm_gated"):  # the pin
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "_get_sm_count", None)
        if original is None or getattr(original, "_auxcap_cpu", False):
            continue

        def sm_count(device, _original=original):
            if torch.device(device).type == "cpu":
                return max(torch.get_num_threads(), 1)
            return _original(device)

        sm_count._auxcap_cpu = True
        module._get_sm_count = sm_count


def spec_draft_tokens():
    """The ``speculative_num_draft_tokens`` a hybrid model's ``MambaPool`` is built with:
    an EAGLE target's (``runner.VERIFY_TOKENS``; its verify forward keeps each draft
    token's intermediate states there), on 0.5.23. The pin's ``MambaPool`` allocates
    those states on ``"cuda"`` whatever its device (pin ``mem_cache/memory_pool.py``
    331, 345), so on the CPU it is built without them (None) and its verify forward
    stops where the linear-attention backend asserts them."""
    from harness.parity.runner import VERIFY_TOKENS

    return VERIFY_TOKENS if _on_0_5_23() else None


def _gdn_config(model_config):
    if _on_0_5_23():
        from sglang.srt.configs.hybrid_arch import hybrid_gdn_config

        return hybrid_gdn_config(model_config)
    from sglang.srt.model_executor.model_runner import ModelRunner

    return ModelRunner.hybrid_gdn_config.fget(runner_view(model_config, None, None))


def gdn_backend(model_config, tp: int, request_lengths: Sequence[int]):
    """``(req_to_token_pool, kv_pool, backend)`` for a hybrid GDN model, built as the
    model runner builds them for an EAGLE target (module docstring; the mamba pool keeps
    the verify chain's intermediate states where it can, :func:`spec_draft_tokens`); requests
    take rows ``1..`` of the req-to-token pool, each with a zeroed mamba slot of its
    own."""
    cfg = _gdn_config(model_config)
    if cfg is None:
        raise ValueError(f"{type(model_config.hf_config).__name__} is not a hybrid GDN config")
    return state_pool_backend(model_config, cfg, tp, request_lengths)


def state_pool_backend(model_config, cfg, tp: int, request_lengths: Sequence[int],
                       **req_pool_kwargs: Any):
    """``(req_to_token_pool, kv_pool, backend)`` of a hybrid model whose linear layers
    keep per-request states in a mamba pool (``cfg``: its hybrid config, with
    ``mamba2_cache_params`` and ``full_attention_layer_ids``): a ``HybridReqToTokenPool``
    (``req_pool_kwargs`` on top), a ``HybridLinearKVPool``, and the backend
    ``attn_backend_wrapper`` builds over ``torch_native``, as the model runner does; each
    request (rows ``1..``) gets a zeroed slot of its own, as the scheduler gives it."""
    import torch
    from sglang.srt.layers.attention.attention_registry import attn_backend_wrapper
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    from harness.parity.runner import attention_backend

    bs, total = len(request_lengths), sum(request_lengths)
    cache_params = cfg.mamba2_cache_params
    req_to_token = _build(
        HybridReqToTokenPool,
        size=bs, mamba_size=bs, mamba_spec_state_size=bs,
        max_context_len=max(request_lengths) + 8, device="cpu", enable_memory_saver=False,
        cache_params=cache_params, mamba_layer_ids=list(cache_params.layers),
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=spec_draft_tokens(),
        enable_overlap_schedule=True, start_layer=0, **req_pool_kwargs,
    )
    kv = _build(
        HybridLinearKVPool,
        page_size=1, size=total + 8, dtype=torch.float32,
        head_num=model_config.get_num_kv_heads(tp), head_dim=model_config.head_dim,
        full_attention_layer_ids=list(cfg.full_attention_layer_ids),
        enable_kvcache_transpose=False, device="cpu", mamba_pool=req_to_token.mamba_pool,
        enable_memory_saver=False, enable_kv_cache_copy=False, use_mla=False, start_layer=0,
    )
    full = attention_backend("torch_native", model_config, req_to_token, kv)
    backend = attn_backend_wrapper(runner_view(model_config, req_to_token, kv), full)
    # The scheduler's part for new requests: a mamba slot each, zeroed before use.
    slots = req_to_token.mamba_allocator.alloc(bs)
    if slots is None:
        raise RuntimeError(f"no {bs} free mamba slots")
    req_to_token.req_index_to_mamba_index_mapping[1:bs + 1] = slots.to(torch.int32)
    req_to_token.mamba_pool.clear_slots(slots)
    return req_to_token, kv, backend
