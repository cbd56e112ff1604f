"""SGLang's side of the parity tier, run in a rank (TP = the pool's world size).

Everything here is SGLang's own code path on the CPU except what has no CPU path:

* the checkpoint is loaded the engine's way: ``ModelConfig(model_path)`` (SGLang's
  config parsing and architecture resolution), ``get_model`` (the default loader: the
  model's own ``load_weights``, TP-sharded by the real parallel linear layers, and
  ``process_weights_after_loading``);
* captures are requested through the function the model runner calls
  (``ModelRunner.init_aux_hidden_state_capture`` at the pin,
  ``configure_aux_hidden_state_capture`` on 0.5.23), so the model's own
  ``set_eagle3_layers_to_capture`` / ``set_dflash_layers_to_capture`` run, through any
  wrapper, and a model without a DFlash setter is refused as the engine refuses it;
* attention is SGLang's ``torch_native`` backend (or ``triton``, interpreted, or a
  family's hybrid backends) over a real ``ReqToTokenPool`` and KV pool (MHA or MLA,
  shaped from ``ModelConfig`` as the model runner shapes them); norms, rotary
  embeddings, linear layers and MoE run their CPU (native) paths under
  ``SGLANG_USE_CPU_ENGINE=1`` (:func:`init`);
* after the extend of a case's prompts, the same pools serve a decode batch, an EAGLE
  verify batch (built with SGLang's own ``build_tree_kernel_efficient`` and
  ``EagleVerifyInput``, run by the triton backend as SGLang's CPU engine verifies) and
  an idle batch (:data:`MODES`, :class:`Requests`);
* at every TP the norms run SGLang's CUDA path with the CUDA kernels' aliasing
  (``fused_add_rmsnorm`` and ``gemma_fused_add_rmsnorm`` write their input and residual
  in place: :mod:`harness.standins.cpu_kernels.cuda_norm`), and each case runs in the
  aliasing variants of :data:`VARIANTS`: at TP > 1 CUDA's out-of-place custom
  all-reduce (:func:`harness.standins.kernels.allreduce_mode`) and, for layers that
  defer their all-reduce, SGLang's FlashInfer fusion, fused (the CPU reference of the
  kernel) and declined (the real wrapper's fallback)
  (:func:`harness.standins.kernels.fusion_mode`); which path each forward took is
  recorded (``paths``) for the tests to assert.

:func:`run_family` returns plain data (tensors, strings) for the controller to compare
with transformers (:mod:`harness.parity.reference`). Stdlib-only at import time.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from types import SimpleNamespace
from typing import Any, Optional, Sequence

# What a rank of a parity pool needs before anything imports SGLang.
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"}
INIT_FN = "harness.parity.runner:init"
# What the parity pools' forkserver imports once (the mode first): see harness/parity/preload.py.
PRELOAD = ("harness.parity.preload",)


def cpu_engine_mode() -> None:
    """What a parity rank needs before SGLang is imported: its CPU engine mode and the
    ops a model module binds at import. Idempotent (the forkserver's preload runs it,
    then each forked rank's :func:`init` again)."""
    os.environ.update(ENV)
    from harness.standins.cpu_engine import install
    from harness.standins.cpu_kernels import qwen3_5 as qwen3_5_ops

    install()
    # Ops a model module binds at import (0.5.23's qwen3_5.py): SGLang's model registry
    # imports every model module at the first load of any family and leaves out, for the
    # process's lifetime, a module whose import failed; a family's setup hook runs too
    # late for them.
    qwen3_5_ops.install()


def init(rank: int, world_size: int, **kwargs: Any):
    """Rank pool init hook: SGLang's CPU engine mode, then its distributed state."""
    cpu_engine_mode()
    from harness.ranks.sglang import init_sglang_distributed

    return init_sglang_distributed(rank, world_size, **kwargs)


# The aliasing variants a case runs in (``harness.parity.families.Family.variants``):
# name -> (fusion mode, all-reduce mode) of harness.standins.kernels.
# * "off": no fusion; the CPU all-reduce, in place (NCCL's semantics);
# * "custom_ar": no fusion; CUDA's custom all-reduce, out of place (a fresh output, the
#   input left as it was), which SGLang picks on CUDA for inputs of these sizes;
# * "flashinfer": SGLang's FlashInfer fusion decision says fuse and the CPU reference of
#   the fused all-reduce + residual + RMSNorm runs (a fresh residual_out);
# * "declined": the same decision, and the real FlashInfer wrapper declines
#   ((None, None)), so SGLang's own fallback runs.
VARIANTS = {
    "off": ("off", "inplace"),
    "custom_ar": ("off", "custom"),
    "flashinfer": ("flashinfer", "inplace"),
    "declined": ("flashinfer_declined", "inplace"),
}
# The variants that run the extend alone, not the later forwards (MODES). What they
# change is the all-reduce's aliasing and the fused norm's fallback, which an extend of
# every capture set already takes in every layer and at the final norm; the decode and
# verify forwards run the same layers over the same code paths with other attention
# metadata, and the verify forward (the interpreted triton backend) is most of the
# tier's cost (about 0.6 s a forward, 1 s for MLA), so running them again per variant
# would add about half the tier's time for no path the extend misses. "flashinfer" too:
# the fusion decision is by token count (FUSE_ALLREDUCE_MAX_BATCH_SIZE), which every
# extend here is under, so its extend takes the fused kernel in every layer and at the
# final norm as a decode would. "off" keeps every forward.
EXTEND_ONLY = ("flashinfer", "custom_ar", "declined")


# ------------------------------------------------------------------ loading


def load(checkpoint: str, dtype: str = "float32"):
    """SGLang's model for ``checkpoint``, built and loaded the way the engine does, in
    ``dtype`` (``--dtype``)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    model_config = ModelConfig(model_path=checkpoint, trust_remote_code=False, dtype=dtype)
    model = get_model(
        model_config=model_config,
        load_config=LoadConfig(load_format="auto"),
        device_config=DeviceConfig("cpu"),
    )
    return model_config, model.eval()


def request_captures(model, eagle3: Any = None, dflash: Any = None,
                     final_layer_capture: Optional[str] = None,
                     deepstack_capture: Optional[str] = None, dspark: bool = False) -> None:
    """Ask ``model`` for captures through what the model runner calls at start-up.

    ``eagle3``: the EAGLE3 draft's ``eagle_aux_hidden_state_layer_ids`` (``"default"``
    for a draft config without them: None); ``dflash``: DFlash's resolved target layer
    ids; ``final_layer_capture``: the draft config's ``final_layer_capture`` (None: the
    key is absent); ``deepstack_capture``: its ``deepstack_capture`` (None: absent, the
    model's default). The pin's ``ModelRunner.init_aux_hidden_state_capture`` reads
    them from the runner, which resolved the last two with ``resolve_final_layer_capture``
    / ``resolve_deepstack_capture``; 0.5.23's ``configure_aux_hidden_state_capture``
    takes them as arguments. A tree without a setting's patch has no resolver for it
    (ImportError) and, on 0.5.23, refuses the argument. ``dspark``: ``dflash``'s ids
    are a DSpark draft's (0.5.23's ``is_dspark``: the model's DSpark setter, where it
    has one); the pin has no DSpark.
    """
    eagle_ids = None if eagle3 in (None, "default") else list(eagle3)
    state = dict(
        eagle_use_aux_hidden_state=eagle3 is not None,
        eagle_aux_hidden_state_layer_ids=eagle_ids,
        dflash_use_aux_hidden_state=dflash is not None,
        dflash_target_layer_ids=None if dflash is None else list(dflash),
    )
    source = "eagle_config" if eagle3 is not None else "dflash_config"
    resolved = "pre_norm"
    if final_layer_capture is not None:
        from sglang.srt.layers.aux_hidden_states import resolve_final_layer_capture

        resolved = resolve_final_layer_capture(
            None, {"final_layer_capture": final_layer_capture}, source)
    if deepstack_capture is not None:
        from sglang.srt.layers.aux_hidden_states import resolve_deepstack_capture

        state["deepstack_capture"] = resolve_deepstack_capture(
            None, {"deepstack_capture": deepstack_capture}, source)
    import importlib.util

    setup = "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
    if importlib.util.find_spec("sglang.srt.model_executor.model_runner_components") is None:
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import get_global_server_args

        if dspark:
            raise ValueError("DSpark drafts are 0.5.23's: the pin has no is_dspark")
        ModelRunner.init_aux_hidden_state_capture(
            SimpleNamespace(model=model, server_args=get_global_server_args(),
                            model_config=SimpleNamespace(num_hidden_layers=_num_layers(model)),
                            final_layer_capture=resolved,
                            **{"deepstack_capture": None, **state}))
        return
    if final_layer_capture is not None:
        state["final_layer_capture"] = resolved
    configure = importlib.import_module(setup).configure_aux_hidden_state_capture
    if "num_layers" in inspect.signature(configure).parameters:
        # What the model runner passes (SpecAuxHiddenStateConfig.target_num_layers),
        # where the tree has it (post-norm-ignored-warning).
        state["num_layers"] = _num_layers(model)
    configure(model=model, is_dspark=dspark, **state)


def _num_layers(model) -> int:
    """The layers a capture id can name, from the model's config as the model runner
    reads it: its text config's ``num_hidden_layers`` (unrolled over a loop model's
    ``num_loops``)."""
    text = getattr(model.config, "text_config", None) or model.config
    return int(text.num_hidden_layers) * int(getattr(text, "num_loops", 1))


# ------------------------------------------------------------------ batch

# The forwards a case runs after the extend of its prompts, in order, on the same pools
# (what the extend wrote is the cached prefix each one attends to):
# * "decode": one token per request (ForwardMode.DECODE);
# * "verify": an EAGLE verify batch of a draft chain (topk 1, VERIFY_STEPS draft steps:
#   the bonus token and the drafts, VERIFY_TOKENS per request; ForwardMode.TARGET_VERIFY,
#   CaptureHiddenMode.FULL) over that prefix, the decode token included;
# * "idle": a batch of no tokens (ForwardMode.IDLE), what a DP-attention rank without
#   requests runs.
MODES = ("decode", "verify", "idle")
VERIFY_STEPS = 2
VERIFY_TOKENS = VERIFY_STEPS + 1
# Tokens each request gains after its prompt: the decode token and the verify chain.
APPENDED = 1 + VERIFY_TOKENS


def _on_0_5_23() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang.srt.runtime_context") is not None


@contextlib.contextmanager
def _speculative_settings():
    """The EAGLE settings of the verify chain (topk 1, VERIFY_STEPS steps, VERIFY_TOKENS
    draft tokens) while pools and backends are built, as the model runner builds them for
    an EAGLE target: the triton backend sizes its verify metadata from them when it is
    constructed. Yields the server args a model-runner namespace hands a backend at the
    pin (the global ones, these fields set until exit); 0.5.23's backends read the runtime
    context's ``spec`` namespace instead, overridden until exit, and None is yielded."""
    fields = dict(speculative_num_draft_tokens=VERIFY_TOKENS,
                  speculative_num_steps=VERIFY_STEPS, speculative_eagle_topk=1)
    if _on_0_5_23():
        from sglang.srt.runtime_context import get_spec

        with get_spec().override(**fields):
            yield None
        return
    from sglang.srt.server_args import get_global_server_args

    server_args = get_global_server_args()
    saved = {name: getattr(server_args, name) for name in fields}
    for name, value in fields.items():
        setattr(server_args, name, value)
    try:
        yield server_args
    finally:
        for name, value in saved.items():
            setattr(server_args, name, value)


def _kv_pool(model_config, tp: int, size: int):
    """The KV pool the model runner would create for ``model_config`` (MHA or MLA), with
    its KV layer count (:func:`harness.parity.triton_attention.num_kv_layers`), in the
    model's dtype (``--kv-cache-dtype auto``)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    from harness.parity.triton_attention import num_kv_layers

    layers = num_kv_layers(model_config)
    if model_config.attention_arch == AttentionArch.MLA:
        return MLATokenToKVPool(
            size=size, page_size=1, dtype=model_config.dtype,
            kv_lora_rank=model_config.kv_lora_rank,
            qk_rope_head_dim=model_config.qk_rope_head_dim,
            layer_num=layers, device="cpu", enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=size, page_size=1, dtype=model_config.dtype,
        head_num=model_config.get_num_kv_heads(tp), head_dim=model_config.head_dim,
        v_head_dim=getattr(model_config, "v_head_dim", None),
        layer_num=layers, device="cpu", enable_memory_saver=False,
    )


def attention_backend(kind: str, model_config, req_to_token, kv,
                      sliding_window: Optional[int] = None, translator=None):
    """SGLang's attention backend ``kind`` over these pools, built from what it reads of
    the model runner (under :func:`_speculative_settings`).

    ``torch_native`` (SDPA) for MHA families; ``triton`` (its kernels run by Triton's
    interpreter, ``TRITON_INTERPRET=1``, :mod:`harness.parity.triton_attention`) for MLA,
    whose no-prefix prefill takes the MHA path with ``save_kv_cache=False``, which
    ``torch_native`` does not implement (it reads K/V back from the latent cache), for
    attention sinks, and for every family's verify batch: ``torch_native`` has no
    TARGET_VERIFY path (it reads the extend lengths a verify batch does not set, and the
    engine refuses EAGLE with it: ``speculative/draft_utils.py``, "EAGLE is not
    supported in decode attention backend torch_native"), so SGLang's CPU engine
    verifies with the triton backend. ``sliding_window``: the model runner's
    ``sliding_window_size`` (:func:`harness.parity.triton_attention.sliding_window_size`),
    which the triton backend sizes its window buffers by; ``translator``: the pools'
    (:func:`harness.parity.triton_attention.kv_index_translator`, one made here if None).
    """
    from types import SimpleNamespace

    with _speculative_settings() as server_args:
        if kind == "torch_native":
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend(
                SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv))
        if kind != "triton":
            raise ValueError(f"attention backend {kind!r}: torch_native or triton")
        from harness.parity.triton_attention import backend, kv_index_translator

        if translator is None:
            translator = kv_index_translator(req_to_token, kv)
        return backend(model_config, req_to_token, kv, server_args, sliding_window, translator)


def _is_mrope(model_config) -> bool:
    """The model runner's M-RoPE decision: ``mrope_section`` in the text config's rope
    parameters (``ModelConfig.model_is_mrope`` on 0.5.23, ``ModelRunner`` at the pin)."""
    flag = getattr(model_config, "model_is_mrope", None)
    if flag is not None:
        return bool(flag)
    text = model_config.hf_text_config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    return rope is not None and "mrope_section" in rope


class Requests:
    """A batch of requests on SGLang's real pools, forward after forward, as the scheduler
    builds each batch: the extend of the prompts (:meth:`extend`), then batches over what
    it cached (:meth:`decode`, :meth:`verify`), and :meth:`idle`.

    ``model``: the loaded model, whose sliding window the model runner hands the triton
    backend (:func:`harness.parity.triton_attention.sliding_window_size`).
    ``attention``: ``torch_native``, ``triton`` (:func:`attention_backend`), or a
    family's own ``"module:function"``, called as ``function(model_config, tp, request_lengths)``
    (each request's whole length, its prompt and the APPENDED tokens) and returning
    ``(req_to_token_pool, kv_pool, backend)``. Request ``i`` is row ``i + 1`` of the
    req-to-token pool; each token forwarded takes the next KV slot from 1 on (slot 0 is
    the pools' padding slot), request by request, and its row entry.
    """

    def __init__(self, model, model_config, prompt_lengths: Sequence[int], tp: int,
                 attention: str = "torch_native"):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from harness.parity.triton_attention import kv_index_translator, sliding_window_size

        self.model_config = model_config
        self.window = sliding_window_size(model, model_config)
        self.bs = len(prompt_lengths)
        capacity = [n + APPENDED for n in prompt_lengths]
        if ":" in attention:  # the family's own pools and backend (e.g. hybrid linear attention)
            from harness.ranks.child import resolve_callable

            with _speculative_settings():
                self.req_to_token, self.kv, self.backend = resolve_callable(attention)(
                    model_config, tp, capacity)
            self.translator = kv_index_translator(self.req_to_token, self.kv)
        else:
            self.req_to_token = ReqToTokenPool(size=self.bs, max_context_len=max(capacity),
                                               device="cpu", enable_memory_saver=False)
            self.kv = _kv_pool(model_config, tp, size=sum(capacity))
            self.translator = kv_index_translator(self.req_to_token, self.kv)
            self.backend = attention_backend(attention, model_config, self.req_to_token, self.kv,
                                             self.window, self.translator)
        self.seq_lens = [0] * self.bs
        self.next_slot = 1
        self._verify_backend = None

    # The pools' bookkeeping, as the scheduler's allocation leaves it.

    def _place(self, counts: Sequence[int]):
        """KV slots for the next ``counts[i]`` tokens of each request, written into its
        req-to-token row after what it holds; returns ``out_cache_loc``."""
        import torch

        out = torch.arange(self.next_slot, self.next_slot + sum(counts), dtype=torch.int64)
        self.next_slot += sum(counts)
        start = 0
        for i, n in enumerate(counts):
            held = self.seq_lens[i]
            row = self.req_to_token.req_to_token[i + 1]
            row[held:held + n] = out[start:start + n].to(torch.int32)
            self.seq_lens[i] += n
            start += n
        return out

    def _batch(self, mode, input_ids, seq_lens, out_cache_loc, positions, backend, **fields):
        """A ``ForwardBatch`` of ``mode``, its attention metadata set up as the model runner
        does before the forward (none for an idle batch: ``forward_idle`` clears it)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

        bs = len(seq_lens)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        fb = ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=input_ids,
            req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64), seq_lens=seq_lens,
            out_cache_loc=out_cache_loc, seq_lens_sum=int(seq_lens.sum()), positions=positions,
            capture_hidden_mode=CaptureHiddenMode.FULL, **fields)
        fb.seq_lens_cpu = seq_lens.clone()
        fb.return_logprob = False
        fb.attn_backend = backend
        fb.req_to_token_pool = self.req_to_token
        fb.token_to_kv_pool = self.kv
        if _is_mrope(self.model_config):
            # Text-only requests: the text positions on all three M-RoPE axes, as
            # ForwardBatch._compute_mrope_positions makes them for a request without images.
            fb.mrope_positions = positions.unsqueeze(0).repeat(3, 1)
        if self.translator is not None:
            # 0.5.23: ForwardBatch.init_new binds every batch to a plan of its KV ids.
            self.translator.bind_own_plan(fb)
        if mode.is_idle():
            backend.forward_metadata = None
        else:
            backend.init_forward_metadata(fb)
        return fb

    def extend(self, prompts: Sequence[Sequence[int]]):
        """The extend batch of ``prompts`` (nothing cached before it)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        lens = [len(p) for p in prompts]
        out_cache_loc = self._place(lens)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
        return self._batch(
            ForwardMode.EXTEND, input_ids, lens, out_cache_loc, positions, self.backend,
            extend_seq_lens=seq_lens.clone(), extend_seq_lens_cpu=list(lens),
            extend_prefix_lens=torch.zeros_like(seq_lens), extend_prefix_lens_cpu=[0] * len(lens),
            extend_start_loc=torch.cumsum(seq_lens, 0) - seq_lens, extend_num_tokens=sum(lens))

    def decode(self, tokens: Sequence[int]):
        """A decode batch: token ``tokens[i]`` for request ``i``, after all it holds
        (``seq_lens`` count it, ``positions`` are ``seq_lens - 1``, as ForwardBatch.init_new
        sets them for a decode batch)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        out_cache_loc = self._place([1] * self.bs)
        seq_lens = list(self.seq_lens)
        positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
        return self._batch(ForwardMode.DECODE, torch.tensor(list(tokens), dtype=torch.int64),
                           seq_lens, out_cache_loc, positions, self.backend)

    def verify(self, chains: Sequence[Sequence[int]]):
        """An EAGLE verify batch: request ``i``'s chain ``chains[i]`` (its bonus token, then
        VERIFY_STEPS draft tokens) after all it holds, built as EAGLE's worker builds it
        for topk 1: the worker's chain ``parent_list`` and ``top_scores_index``
        (``EAGLEWorkerV2._rebuild_topk1_chain_buffers``), SGLang's
        ``build_tree_kernel_efficient`` (the tree mask, FULL_MASK as the triton backend
        reads it, and the positions; the sgl-kernel op by its CPU version,
        :mod:`harness.standins.cpu_engine.tree`), an ``EagleVerifyInput``, and the KV slots
        of the chain in the request's row (``prepare_for_verify``); ``seq_lens`` are the
        prefix lengths (the chain not counted). Run by the triton backend over the same
        pools (:func:`attention_backend`)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        from sglang.srt.speculative.eagle_utils import TreeMaskMode, build_tree_kernel_efficient

        chains = torch.tensor([list(c) for c in chains], dtype=torch.int64)
        if chains.shape != (self.bs, VERIFY_TOKENS):
            raise ValueError(f"verify chains of shape {tuple(chains.shape)}, "
                             f"not ({self.bs}, {VERIFY_TOKENS})")
        prefix = list(self.seq_lens)
        prefix_lens = torch.tensor(prefix, dtype=torch.int64)
        parent_width = VERIFY_STEPS if VERIFY_STEPS > 1 else 0
        parent_list = torch.arange(-1, parent_width - 1, dtype=torch.int64).repeat(self.bs, 1)
        top_scores_index = torch.arange(VERIFY_STEPS, dtype=torch.int64).repeat(self.bs, 1)
        (tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling,
         draft_tokens) = build_tree_kernel_efficient(
            chains[:, 0].clone(), parent_list, top_scores_index, chains[:, 1:].contiguous(),
            prefix_lens.clone(), sum(prefix), 1, VERIFY_STEPS, VERIFY_TOKENS,
            TreeMaskMode.FULL_MASK)
        spec_info = EagleVerifyInput(
            draft_token=draft_tokens, custom_mask=tree_mask, positions=positions,
            retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
            retrieve_next_sibling=retrieve_next_sibling, retrieve_cum_len=None,
            spec_steps=VERIFY_STEPS, topk=1, draft_token_num=VERIFY_TOKENS,
            capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=sum(prefix),
            seq_lens_cpu=prefix_lens.clone())
        out_cache_loc = self._place([VERIFY_TOKENS] * self.bs)
        return self._batch(ForwardMode.TARGET_VERIFY, draft_tokens, prefix, out_cache_loc,
                           positions, self.verify_backend(), spec_info=spec_info)

    def idle(self):
        """An idle batch: no requests, no tokens."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        empty = torch.empty((0,), dtype=torch.int64)
        return self._batch(ForwardMode.IDLE, empty, [], empty.clone(), empty.clone(), self.backend)

    def verify_backend(self):
        """The triton backend over these pools: :attr:`backend` where it is one; a hybrid
        backend keeps its linear-attention half and gets a triton full-attention half."""
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        if self._verify_backend is None:
            backend = self.backend
            full = getattr(backend, "full_attn_backend", backend)
            if isinstance(full, TritonAttnBackend):
                self._verify_backend = backend
            else:
                triton = attention_backend("triton", self.model_config, self.req_to_token,
                                           self.kv, self.window, self.translator)
                self._verify_backend = triton if full is backend else type(backend)(
                    triton, backend.linear_attn_backend, backend.full_attn_layers)
        return self._verify_backend


@contextlib.contextmanager
def _forward_context(backend):
    """SGLang's per-forward context, where the base has one (the model runner opens it)."""
    try:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    except ImportError:
        yield
        return
    with forward_context(ForwardContext(attn_backend=backend)):
        yield


# ------------------------------------------------------------------ running


def _logits_processors(model) -> list:
    """Every LogitsProcessor under ``model``: a wrapper may keep its language model's, or
    hold one of its own that its forward never calls (mllama4's
    ``Llama4ForConditionalGeneration`` runs ``language_model``'s)."""
    lps = [sub for sub in model.modules() if type(sub).__name__ == "LogitsProcessor"]
    if not lps:
        raise RuntimeError(f"{type(model).__name__} has no LogitsProcessor")
    return lps


def forward(model, forward_batch) -> dict[str, Any]:
    """One forward of ``forward_batch`` (:class:`Requests`), as the model runner calls the
    model; what reached the logits processor and what it handed on
    (``next_token_logits``, and ``hidden_states``: the packed aux captures for every
    token, what the draft model receives), and ``paths``: what the stand-ins counted
    during it (:data:`harness.standins.kernels.PATHS`)."""
    import collections

    import torch

    from harness.standins import kernels

    lps = _logits_processors(model)
    sig = inspect.signature(type(lps[0]).forward)
    seen: dict[str, Any] = {}

    def hook(module, args, kwargs):
        bound = sig.bind(module, *args, **kwargs)
        seen["final"] = bound.arguments["hidden_states"].detach().clone()
        aux = bound.arguments.get("aux_hidden_states")
        if aux is None:
            seen["num_aux"] = 0
        elif isinstance(aux, torch.Tensor):
            seen["num_aux"] = aux.shape[-1] // seen["final"].shape[-1]
        else:
            seen["num_aux"] = len(aux)

    handles = [lp.register_forward_pre_hook(hook, with_kwargs=True) for lp in lps]
    fb = forward_batch
    before = collections.Counter(kernels.PATHS)
    try:
        with torch.no_grad(), _forward_context(fb.attn_backend):
            out = model(fb.input_ids, fb.positions, fb)
    finally:
        for handle in handles:
            handle.remove()
    if "final" not in seen:
        raise RuntimeError("the logits processor never ran")
    aux = getattr(out, "hidden_states", None)
    return {
        "final": seen["final"],
        "num_aux": seen["num_aux"],
        "aux": None if aux is None or seen["num_aux"] == 0 else aux.detach().clone(),
        "logits": out.next_token_logits.detach().clone(),
        "paths": kernels.paths_since(before),
    }


def run_requests(model, model_config, prompts, tp: int, attention: str = "torch_native",
                 appended: Sequence[Sequence[int]] = (), modes: Sequence[str] = ()) -> dict:
    """The extend of ``prompts`` on fresh pools, then each of ``modes`` (of MODES, in
    MODES' order) over what it cached: the extend's :func:`forward` result, with
    ``modes``: {mode: its result, or {"error": traceback}} and ``seconds`` per forward.

    ``appended[i]``: request ``i``'s APPENDED tokens after its prompt, its decode token
    and then its verify chain. The verify batch's prefix holds the decode token, so it
    does not run when the decode forward failed."""
    import time

    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"modes {sorted(unknown)}: not in {MODES}")
    requests = Requests(model, model_config, [len(p) for p in prompts], tp, attention)
    t0 = time.monotonic()
    res = forward(model, requests.extend(prompts))
    seconds = {"extend": time.monotonic() - t0}
    batches = {
        "decode": lambda: requests.decode([a[0] for a in appended]),
        "verify": lambda: requests.verify([a[1:] for a in appended]),
        "idle": requests.idle,
    }
    res["modes"] = {}
    for mode in MODES:
        if mode not in modes:
            continue
        t0 = time.monotonic()
        if mode == "verify" and "error" in res["modes"].get("decode", {}):
            res["modes"][mode] = {"error": "not run: its prefix holds the decode token, "
                                           "whose forward failed (the decode case says why)"}
            continue
        try:
            res["modes"][mode] = forward(model, batches[mode]())
        except Exception:
            res["modes"][mode] = {"error": traceback.format_exc()}
        seconds[mode] = time.monotonic() - t0
    res["seconds"] = seconds
    return res


def _layers_to_capture(model) -> Optional[list]:
    for sub in model.modules():
        ltc = getattr(sub, "layers_to_capture", None)
        if ltc is not None and not isinstance(sub, type(model)):
            return [int(i) for i in ltc]
    ltc = getattr(model, "layers_to_capture", None)
    return None if ltc is None else [int(i) for i in ltc]


_SETUP_DONE: set = set()


def run_case(checkpoint: str, prompts, tp: int, capture: dict, fusions: Sequence[str],
             attention: str = "torch_native", setup: str = "",
             then: Sequence[dict] = (), appended: Sequence[Sequence[int]] = (),
             modes: Sequence[str] = ()) -> list:
    """Build the model (its norms on SGLang's CUDA path, in place:
    :mod:`harness.standins.cpu_kernels.cuda_norm`), request ``capture`` ({"eagle3": ids}
    / {"dflash": ids} / {}), run the extend of ``prompts`` and then ``modes`` over its
    cache (:func:`run_requests`) in each aliasing variant of ``fusions`` (names of
    :data:`VARIANTS`); one result dict per variant (an ``error`` string on failure).

    ``then``: further requests on the same loaded model, each made through the model
    runner's function again and run in every variant after ``capture``'s, their
    results following in order (the ``post_norm`` set after the ``eagle3`` one: the
    same ids, so a model load less per family and TP).

    ``setup``: a family's ``"module:function"`` run once per process before its first
    model is built (e.g. installing the CPU version of a kernel that has no CPU path)."""
    import time

    from harness.standins.cpu_kernels import cuda_norm
    from harness.standins.kernels import allreduce_mode, fusion_mode

    requests = [capture, *then]
    t0 = time.monotonic()
    try:
        if setup and setup not in _SETUP_DONE:
            from harness.ranks.child import resolve_callable

            resolve_callable(setup)()
            _SETUP_DONE.add(setup)
        model_config, model = load(checkpoint)
        cuda_norm.install(model)
    except Exception:
        err = traceback.format_exc()
        return [{"error": err} for _ in requests for _ in fusions]
    load_seconds = time.monotonic() - t0
    results = []
    for request in requests:
        try:
            request_captures(model, **request)
            ltc = _layers_to_capture(model) if request else []
        except Exception:
            err = traceback.format_exc()
            results += [{"error": err} for _ in fusions]
            continue
        for variant in fusions:
            fusion, all_reduce = VARIANTS[variant]
            try:
                with fusion_mode(fusion), allreduce_mode(all_reduce):
                    res = run_requests(model, model_config, prompts, tp, attention,
                                       appended, () if variant in EXTEND_ONLY else modes)
                res["seconds"]["load"] = load_seconds
                res["layers_to_capture"] = ltc
                results.append(res)
            except Exception:
                results.append({"error": traceback.format_exc()})
    return results


def run_family(rank: int, world_size: int, cases: Sequence[dict]) -> list:
    """Rank task: every case (``checkpoint``, ``prompts``, ``capture``, ``fusions``, and
    optionally ``attention``, ``setup``, ``then``, ``appended``, ``modes``) on this pool's
    TP; a list of result lists, in order."""
    return [run_case(c["checkpoint"], c["prompts"], world_size, c["capture"], c["fusions"],
                     c.get("attention", "torch_native"), c.get("setup", ""), c.get("then", ()),
                     c.get("appended", ()), c.get("modes", ()))
            for c in cases]
