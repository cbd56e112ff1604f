"""A tiny real ``DeepseekV2Model`` with TP-sharded stand-ins for attention and MLP.

Everything here drives SGLang's own code: ``DeepseekV2Model.forward``,
``DeepseekV2DecoderLayer.forward``, its ``LayerCommunicator`` (prepare_attn,
prepare_mlp, postprocess_layer, should_fuse_mlp_allreduce_with_next_layer), its
``RMSNorm`` and ``forward_with_allreduce_fusion``, SGLang's ``GroupCoordinator``
all-reduce, and the logits processor. Attention (MLA) and the MLP/MoE compute are
small TP-sharded modules: a column-parallel ``[H, I/tp]`` projection in and a
row-parallel ``[I/tp, H]`` projection out, so each rank holds a partial sum and
SGLang's communicator (or the MLP's own all-reduce) completes it, exactly as the real
layers do.
"""

from __future__ import annotations

from typing import Any, Sequence

from harness.standins.batch import make_forward_batch
from harness.standins.blocks import TinyConfig, _full_weight, _ShardedBlock
from harness.standins.kernels import (
    _torch,
    device,
    has_real_kernels,
    install_cpu_norm,
    model_dtype,
)


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

    Requires SGLang's distributed state (harness.ranks.sglang.init_sglang_distributed).
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
