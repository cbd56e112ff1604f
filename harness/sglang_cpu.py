"""CPU stand-ins for SGLang's GPU-only kernels, and a tiny real DeepseekV2Model.

Everything here drives SGLang's own code: ``DeepseekV2Model.forward``,
``DeepseekV2DecoderLayer.forward``, its ``LayerCommunicator`` (prepare_attn,
prepare_mlp, postprocess_layer, should_fuse_mlp_allreduce_with_next_layer), its
``RMSNorm`` and ``forward_with_allreduce_fusion``, SGLang's ``GroupCoordinator``
all-reduce, and the logits processor. Only these are replaced, and only on a
machine without the real kernels:

* attention (MLA) and the MLP/MoE compute, by small TP-sharded modules: a
  column-parallel ``[H, I/tp]`` projection in and a row-parallel ``[I/tp, H]``
  projection out, so each rank holds a partial sum and SGLang's communicator (or
  the MLP's own all-reduce) completes it, exactly as the real layers do;
* the CUDA ``fused_add_rmsnorm`` (RMSNorm with a residual), by a CPU version with
  the same aliasing: ``residual`` and ``x`` are updated in place and returned;
* FlashInfer's fused all-reduce + residual + RMSNorm, by a CPU reference that
  all-reduces over the real TP group and returns a *fresh* ``residual_out`` and
  ``norm_out`` (the kernel's aliasing);
* the aiter fused all-reduce + RMSNorm, by a CPU reference that updates its inputs
  in place (its aliasing), for the "aiter-like" fusion mode.

Exactness: weights are small integers and the stand-ins round their (normalized)
input to a small integer grid before multiplying, so every partial sum, and every
all-reduce of partial sums, is an integer held exactly in float64. TP=1, 2 and 4
therefore give bit-identical captures, whatever the reduction order.

Stdlib-only at import time; torch and sglang are imported inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, List, Optional, Sequence

FUSION_MODES = ("off", "flashinfer", "aiter")


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    num_layers: int = 8
    hidden_size: int = 16
    intermediate_size: int = 32
    vocab_size: int = 64
    seed: int = 1234
    dtype: str = "float64"
    first_k_dense_replace: int = 0


def _torch():
    import torch

    return torch


def has_real_kernels() -> bool:
    """True on a CUDA machine: stand-ins switch off and the real kernels run."""
    return device().startswith("cuda")


def device() -> str:
    """``$HARNESS_DEVICE``, else ``cuda`` (the rank's current device) when available."""
    import os

    torch = _torch()
    want = os.environ.get("HARNESS_DEVICE")
    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return want


def model_dtype(cfg: "TinyConfig"):
    """float64 on CPU; CUDA kernels (RMSNorm, FlashInfer) take float32, still exact for
    the small integers these tests produce."""
    torch = _torch()
    dtype = getattr(torch, cfg.dtype)
    if has_real_kernels() and dtype == torch.float64:
        return torch.float32
    return dtype


# --------------------------------------------------------------------------
# kernel stand-ins
# --------------------------------------------------------------------------


def _rms(x, weight, eps):
    torch = _torch()
    orig = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(orig) * weight.to(orig)


def cpu_rmsnorm_forward(norm, x, residual=None, post_residual_addition=None):
    """RMSNorm with the CUDA kernels' aliasing (``fused_add_rmsnorm`` is in place)."""
    if x.shape[0] == 0:
        return x if residual is None else (x, residual)
    if residual is None:
        return _rms(x, norm.weight.data, norm.variance_epsilon)
    if post_residual_addition is not None:
        residual = residual + post_residual_addition
    # fused_add_rmsnorm(x, residual, w, eps): residual += x; x = rmsnorm(residual) * w
    residual.add_(x)
    x.copy_(_rms(residual, norm.weight.data, norm.variance_epsilon))
    return x, residual


def install_cpu_norm(module) -> int:
    """Route every SGLang RMSNorm under ``module`` to the in-place CPU kernel."""
    import functools

    from sglang.srt.layers.layernorm import RMSNorm

    n = 0
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            sub._forward_method = functools.partial(cpu_rmsnorm_forward, sub)
            n += 1
    return n


def _reduce_group(use_attn_tp_group: bool):
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.layers.dp_attention import get_attention_tp_group

    return get_attention_tp_group() if use_attn_tp_group else get_tp_group()


def cpu_flashinfer_allreduce_residual_rmsnorm(
    input_tensor,
    residual,
    weight,
    eps: float = 1e-6,
    max_token_num: int = 2048,
    use_oneshot=None,
    trigger_completion_at_end: bool = False,
    fp32_acc: bool = False,
    use_attn_tp_group: bool = True,
):
    """CPU reference of FlashInfer's kARResidualRMSNorm: fresh outputs, inputs untouched."""
    torch = _torch()
    group = _reduce_group(use_attn_tp_group)
    if group.world_size <= 1:
        return None, None
    if not (input_tensor.is_contiguous() and residual.is_contiguous()):
        return None, None
    assert input_tensor.shape[0] <= max_token_num
    reduced = group.all_reduce(input_tensor.clone())
    residual_out = torch.empty_like(residual)
    torch.add(reduced, residual, out=residual_out)
    norm_out = torch.empty_like(input_tensor)
    norm_out.copy_(_rms(residual_out, weight, eps))
    return norm_out, residual_out


def cpu_aiter_fused_allreduce_rmsnorm(x, residual, weight, eps):
    """CPU reference of an in-place fused all-reduce + add + RMSNorm (aiter-like)."""
    group = _reduce_group(True)
    reduced = group.all_reduce(x.clone())
    residual.add_(reduced)
    x.copy_(_rms(residual, weight, eps))
    return x, residual


@contextlib.contextmanager
def fusion_mode(mode: str) -> Iterator[None]:
    """Switch SGLang's all-reduce fusion decision and kernels for the duration.

    ``off``: the pin's CPU behaviour (no fusion). ``flashinfer``: SGLang's own
    FlashInfer decision logic runs with the hardware check answered yes, and the
    kernel is the CPU reference (fresh ``residual_out``). ``aiter``: SGLang's aiter
    fusion branch, with an in-place CPU reference kernel.
    """
    if mode not in FUSION_MODES:
        raise ValueError(f"fusion mode {mode!r} not in {FUSION_MODES}")
    from sglang.srt.layers import communicator, flashinfer_comm_fusion, layernorm
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.server_args import get_global_server_args

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    sa = get_global_server_args()
    patch(sa, "enable_flashinfer_allreduce_fusion", mode == "flashinfer")
    patch(sa, "enable_aiter_allreduce_fusion", mode == "aiter")
    if mode == "flashinfer" and not has_real_kernels():
        max_bs = communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE

        def apply_flashinfer_allreduce_fusion(batch_size: int):
            # The pin's predicate with the sm90/sm100 + flashinfer check answered yes.
            return (
                batch_size > 0
                and batch_size <= max_bs
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_flashinfer_allreduce_fusion
            )

        patch(communicator, "apply_flashinfer_allreduce_fusion", apply_flashinfer_allreduce_fusion)
        patch(
            flashinfer_comm_fusion,
            "flashinfer_allreduce_residual_rmsnorm",
            cpu_flashinfer_allreduce_residual_rmsnorm,
        )
    elif mode == "aiter":
        patch(communicator, "_use_aiter", True)
        patch(layernorm, "_use_aiter", True)

        def apply_aiter_all_reduce_fusion(input_tensor):
            return (
                input_tensor.numel() > 0
                and not is_dp_attention_enabled()
                and get_global_server_args().enable_aiter_allreduce_fusion
            )

        patch(communicator, "apply_aiter_all_reduce_fusion", apply_aiter_all_reduce_fusion)
        import sglang.srt.distributed as dist_pkg

        patch(
            dist_pkg,
            "tensor_model_parallel_fused_allreduce_rmsnorm",
            cpu_aiter_fused_allreduce_rmsnorm,
        )
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# --------------------------------------------------------------------------
# the tiny model
# --------------------------------------------------------------------------


def _full_weight(seed: int, tag: int, shape: Sequence[int]):
    torch = _torch()
    g = torch.Generator().manual_seed(seed * 1000 + tag)
    return torch.randint(-1, 2, tuple(shape), generator=g).to(torch.float64)


def _quantize(x):
    # A small integer grid: normalized activations are O(1).
    return (x.to(_torch().float64) * 2).round()


class _ShardedBlock:
    """Column-parallel in, row-parallel out: this rank's partial sum of relu(q W1) W2."""

    def _init_shards(self, seed, tag, hidden, inter, tp_rank, tp_size, dtype):
        torch = _torch()
        w1 = _full_weight(seed, tag, (hidden, inter))
        w2 = _full_weight(seed, tag + 1, (inter, hidden))
        cols = torch.arange(inter).tensor_split(tp_size)[tp_rank]
        self.w1 = w1[:, cols].to(dtype).contiguous()
        self.w2 = w2[cols, :].to(dtype).contiguous()

    def _partial(self, x):
        torch = _torch()
        q = _quantize(x).to(self.w1.dtype)
        return torch.relu(q @ self.w1) @ self.w2


def _make_attention_cls(cfg: TinyConfig, tp_rank: int, tp_size: int):
    torch = _torch()
    dtype = model_dtype(cfg)

    class StandInAttention(torch.nn.Module, _ShardedBlock):
        """Stands in for DeepseekV2AttentionMLA: returns this rank's partial sum (o_proj
        is row-parallel with reduce_results=False; the communicator all-reduces)."""

        def __init__(self, *, layer_id: int = 0, **_: Any):
            torch.nn.Module.__init__(self)
            self.layer_id = layer_id
            self._init_shards(cfg.seed, 10 * layer_id + 1, cfg.hidden_size,
                              cfg.intermediate_size, tp_rank, tp_size, dtype)

        def prepare_qkv_latent(self, hidden_states, forward_batch):
            return hidden_states

        def forward(self, positions, hidden_states, forward_batch, zero_allocator=None,
                    llama_4_scaling=None, layer_scatter_modes=None, prev_topk_indices=None,
                    **_: Any):
            from sglang.srt.layers.communicator import get_attn_tp_context

            if get_attn_tp_context().input_scattered:
                # As MLA does: q_lora on this rank's tokens, then attention over all
                # tokens of the TP group (AttentionInputs all-gathers them).
                hidden_states = get_attn_tp_context().fetch_hidden_states()
            if hidden_states.shape[0] == 0:
                return hidden_states.clone()
            return self._partial(hidden_states)

    return StandInAttention


def _make_mlp_cls(cfg: TinyConfig, tp_rank: int, tp_size: int):
    torch = _torch()
    dtype = model_dtype(cfg)

    class StandInMLP(torch.nn.Module, _ShardedBlock):
        """Stands in for DeepseekV2MLP: gate/up column-parallel, down row-parallel; the
        down projection all-reduces unless the layer defers it (fusion / reduce-scatter),
        as RowParallelLinear(skip_all_reduce=...) does."""

        def __init__(self, *_, prefix: str = "", **__):
            torch.nn.Module.__init__(self)
            # DeepseekV2DecoderLayer builds its MLP with prefix "...layers.<id>.mlp".
            layer_id = int(prefix.split(".")[-2])
            self._init_shards(cfg.seed, 10 * layer_id + 5, cfg.hidden_size,
                              cfg.intermediate_size, tp_rank, tp_size, dtype)

        def forward(self, x, forward_batch=None, should_allreduce_fusion=False,
                    use_reduce_scatter=False, gemm_output_zero_allocator=None):
            from sglang.srt.distributed import tensor_model_parallel_all_reduce

            if x.shape[0] == 0:
                return x.clone()
            out = self._partial(x)
            if tp_size > 1 and not (should_allreduce_fusion or use_reduce_scatter):
                out = tensor_model_parallel_all_reduce(out)
            return out

    return StandInMLP


def make_config(cfg: TinyConfig):
    from transformers import PretrainedConfig

    return PretrainedConfig(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        vocab_size=cfg.vocab_size,
        hidden_act="silu",
        n_routed_experts=None,
        n_shared_experts=None,
        first_k_dense_replace=cfg.first_k_dense_replace,
        moe_layer_freq=1,
        num_experts_per_tok=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_tiny_deepseek(cfg: TinyConfig = TinyConfig()):
    """Builds SGLang's real DeepseekV2Model with CPU stand-ins for attention and MLP.

    Requires SGLang's distributed state (harness.sglang_dist.init_sglang_distributed).
    Embeddings are integer-valued; the final norm and every layer norm use the CPU
    in-place kernel when no GPU is present.
    """
    import unittest.mock as mock

    torch = _torch()
    from sglang.srt.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from sglang.srt.models import deepseek_v2

    tp_rank = get_tensor_model_parallel_rank()
    tp_size = get_tensor_model_parallel_world_size()
    attn_cls = _make_attention_cls(cfg, tp_rank, tp_size)
    mlp_cls = _make_mlp_cls(cfg, tp_rank, tp_size)
    config = make_config(cfg)
    with mock.patch.object(deepseek_v2, "DeepseekV2AttentionMLA", attn_cls), \
            mock.patch.object(deepseek_v2, "DeepseekV2MLP", mlp_cls):
        model = deepseek_v2.DeepseekV2Model(config, quant_config=None)
    dtype = model_dtype(cfg)
    model.to(device=device(), dtype=dtype)
    with torch.no_grad():
        emb = model.embed_tokens.weight
        full = (_full_weight(cfg.seed, 999, (cfg.vocab_size, cfg.hidden_size)) * 3).to(emb.device)
        # VocabParallelEmbedding shards the vocab; pick this rank's rows.
        shard = getattr(model.embed_tokens, "shard_indices", None)
        if shard is not None:
            full = full[shard.org_vocab_start_index : shard.org_vocab_end_index]
        emb.zero_()
        emb[: full.shape[0]].copy_(full.to(dtype))
    if not has_real_kernels():
        install_cpu_norm(model)
    return model


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


def run_model(model, input_ids, layers_to_capture: Sequence[int], mode: str = "extend"):
    """Runs the real DeepseekV2Model.forward (inside SGLang's ``maybe_input_scattered``,
    as DeepseekV2ForCausalLM.forward does); returns (final_hidden, captures or None)."""
    torch = _torch()
    from sglang.srt.layers.communicator import get_attn_tp_context

    model.layers_to_capture = list(layers_to_capture)
    fb = make_forward_batch(input_ids, mode)
    input_ids = input_ids.to(device())
    positions = torch.arange(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
    with torch.no_grad(), get_attn_tp_context().maybe_input_scattered(fb):
        out = model(input_ids, positions, fb)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None
