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
* attention is SGLang's ``torch_native`` backend over a real ``ReqToTokenPool`` and
  KV pool (MHA or MLA, shaped from ``ModelConfig`` as the model runner shapes them);
  norms, rotary embeddings, linear layers and MoE run their CPU (native) paths under
  ``SGLANG_USE_CPU_ENGINE=1`` (:func:`init`);
* at TP > 1 the norms take the CUDA kernels' aliasing (``fused_add_rmsnorm`` in place,
  :func:`harness.standins.kernels.install_cpu_norm`), and ``fusion="flashinfer"``
  switches SGLang's own fusion decision on with the CPU reference of FlashInfer's fused
  all-reduce + residual + RMSNorm (:func:`harness.standins.kernels.fusion_mode`).

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
                     deepstack_capture: Optional[str] = None) -> None:
    """Ask ``model`` for captures through what the model runner calls at start-up.

    ``eagle3``: the EAGLE3 draft's ``eagle_aux_hidden_state_layer_ids`` (``"default"``
    for a draft config without them: None); ``dflash``: DFlash's resolved target layer
    ids; ``final_layer_capture``: the draft config's ``final_layer_capture`` (None: the
    key is absent); ``deepstack_capture``: its ``deepstack_capture`` (None: absent, the
    model's default). The pin's ``ModelRunner.init_aux_hidden_state_capture`` reads
    them from the runner, which resolved the last two with ``resolve_final_layer_capture``
    / ``resolve_deepstack_capture``; 0.5.23's ``configure_aux_hidden_state_capture``
    takes them as arguments. A tree without a setting's patch has no resolver for it
    (ImportError) and, on 0.5.23, refuses the argument.
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
    configure(model=model, is_dspark=False, **state)


def _num_layers(model) -> int:
    """The layers a capture id can name, from the model's config as the model runner
    reads it: its text config's ``num_hidden_layers`` (unrolled over a loop model's
    ``num_loops``)."""
    text = getattr(model.config, "text_config", None) or model.config
    return int(text.num_hidden_layers) * int(getattr(text, "num_loops", 1))


# ------------------------------------------------------------------ batch


def _kv_pool(model_config, tp: int, size: int):
    """The KV pool the model runner would create for ``model_config`` (MHA or MLA), in
    the model's dtype (``--kv-cache-dtype auto``)."""
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    layers = model_config.num_hidden_layers
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


def attention_backend(kind: str, model_config, req_to_token, kv):
    """SGLang's attention backend ``kind`` over these pools, built from what it reads of
    the model runner.

    ``torch_native`` (SDPA) for MHA families; ``triton`` (its kernels run by Triton's
    interpreter, ``TRITON_INTERPRET=1``) for MLA, whose no-prefix prefill takes the
    MHA path with ``save_kv_cache=False``, which ``torch_native`` does not implement
    (it reads K/V back from the latent cache).
    """
    import torch

    if kind == "torch_native":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(
            SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv))
    if kind != "triton":
        raise ValueError(f"attention backend {kind!r}: torch_native or triton")
    import importlib.util

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if importlib.util.find_spec("sglang.srt.runtime_context") is None:  # the pin
        from sglang.srt.server_args import get_global_server_args

        server_args = get_global_server_args()
    else:  # 0.5.23 reads its runtime context instead (and refuses the global)
        server_args = None
    translator = None
    if importlib.util.find_spec("sglang.srt.mem_cache.kv_index_translator") is not None:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        # 0.5.23's model runner hands backends this one converter of KV ids.
        translator = KVIndexTranslator(req_to_token=req_to_token.req_to_token,
                                       token_to_kv_pool_allocator=None, token_to_kv_pool=kv,
                                       page_size=1, device="cpu", is_draft_worker=False)
    runner = SimpleNamespace(
        device="cpu", gpu_id=0, model_config=model_config, server_args=server_args,
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, token_to_kv_pool_allocator=None,
        sliding_window_size=None, hybrid_gdn_config=None, kimi_linear_config=None,
        linear_attn_model_spec=None, is_draft_worker=False, kv_cache_dtype=model_config.dtype,
        kv_index_translator=translator, decode_num_tokens_per_req=lambda: 1,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    return TritonAttnBackend(runner)


def _is_mrope(model_config) -> bool:
    """The model runner's M-RoPE decision: ``mrope_section`` in the text config's rope
    parameters (``ModelConfig.model_is_mrope`` on 0.5.23, ``ModelRunner`` at the pin)."""
    flag = getattr(model_config, "model_is_mrope", None)
    if flag is not None:
        return bool(flag)
    text = model_config.hf_text_config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    return rope is not None and "mrope_section" in rope


def extend_batch(model_config, prompts: Sequence[Sequence[int]], tp: int,
                 attention: str = "torch_native"):
    """A real extend ``ForwardBatch`` of ``prompts`` with the ``attention`` backend.

    ``attention``: ``torch_native``, ``triton`` (:func:`attention_backend`), or a family's
    own ``"module:function"``, called as ``function(model_config, tp, prompt_lengths)``
    and returning ``(req_to_token_pool, kv_pool, backend)`` (rows ``1..`` of
    ``req_to_token`` and token slots ``1..`` are the requests', filled here).
    Returns ``(input_ids, positions, forward_batch, backend)``.
    """
    import torch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    lens = [len(p) for p in prompts]
    total, bs = sum(lens), len(lens)
    if ":" in attention:  # the family's own pools and backend (e.g. hybrid linear attention)
        from harness.ranks.child import resolve_callable

        req_to_token, kv, backend = resolve_callable(attention)(model_config, tp, lens)
    else:
        req_to_token = ReqToTokenPool(size=bs, max_context_len=max(lens) + 8, device="cpu",
                                      enable_memory_saver=False)
        kv = _kv_pool(model_config, tp, size=total + 8)
        backend = attention_backend(attention, model_config, req_to_token, kv)
    # Token slot 0 is the pools' padding slot; requests take rows 1.. and slots 1..
    out_cache_loc = torch.arange(1, total + 1, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens):
        req_to_token.req_to_token[i + 1, :n] = out_cache_loc[start:start + n].to(torch.int32)
        start += n
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64),
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        seq_lens_sum=total,
        positions=positions,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    fb.seq_lens_cpu = seq_lens.clone()
    fb.extend_seq_lens = seq_lens.clone()
    fb.extend_seq_lens_cpu = list(lens)
    fb.extend_prefix_lens = torch.zeros_like(seq_lens)
    fb.extend_prefix_lens_cpu = [0] * bs
    fb.extend_start_loc = torch.cumsum(seq_lens, 0) - seq_lens
    fb.extend_num_tokens = total
    fb.return_logprob = False
    fb.attn_backend = backend
    fb.req_to_token_pool = req_to_token
    fb.token_to_kv_pool = kv
    if _is_mrope(model_config):
        # Text-only requests: the text positions on all three M-RoPE axes, as
        # ForwardBatch._compute_mrope_positions makes them for a request without images.
        fb.mrope_positions = positions.unsqueeze(0).repeat(3, 1)
    backend.init_forward_metadata(fb)
    return input_ids, positions, fb, backend


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


def forward(model, model_config, prompts, tp: int, attention: str = "torch_native") -> dict[str, Any]:
    """One extend forward of ``prompts``; what reached the logits processor and what it
    handed on (``next_token_logits``, and ``hidden_states``: the packed aux captures
    for every token, what the draft model receives)."""
    import torch

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
    try:
        input_ids, positions, fb, backend = extend_batch(model_config, prompts, tp, attention)
        with torch.no_grad(), _forward_context(backend):
            out = model(input_ids, positions, fb)
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
    }


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
             then: Sequence[dict] = ()) -> list:
    """Build the model, request ``capture`` ({"eagle3": ids} / {"dflash": ids} / {}), run
    each fusion mode; one result dict per fusion (an ``error`` string on failure).

    ``then``: further requests on the same loaded model, each made through the model
    runner's function again and run in every fusion mode after ``capture``'s, their
    results following in order (the ``post_norm`` set after the ``eagle3`` one: the
    same ids, so a model load less per family and TP).

    ``setup``: a family's ``"module:function"`` run once per process before its first
    model is built (e.g. installing the CPU version of a kernel that has no CPU path)."""
    import time

    from harness.standins.kernels import fusion_mode, install_cpu_norm

    requests = [capture, *then]
    t0 = time.monotonic()
    try:
        if setup and setup not in _SETUP_DONE:
            from harness.ranks.child import resolve_callable

            resolve_callable(setup)()
            _SETUP_DONE.add(setup)
        model_config, model = load(checkpoint)
        if tp > 1:
            install_cpu_norm(model)
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
        for fusion in fusions:
            try:
                t1 = time.monotonic()
                with fusion_mode(fusion):
                    res = forward(model, model_config, prompts, tp, attention)
                res["seconds"] = {"load": load_seconds, "forward": time.monotonic() - t1}
                res["layers_to_capture"] = ltc
                results.append(res)
            except Exception:
                results.append({"error": traceback.format_exc()})
    return results


def run_family(rank: int, world_size: int, cases: Sequence[dict]) -> list:
    """Rank task: every case (``checkpoint``, ``prompts``, ``capture``, ``fusions``, and
    optionally ``then``) on this pool's TP; a list of result lists, in order."""
    return [run_case(c["checkpoint"], c["prompts"], world_size, c["capture"], c["fusions"],
                     c.get("attention", "torch_native"), c.get("setup", ""), c.get("then", ()))
            for c in cases]
