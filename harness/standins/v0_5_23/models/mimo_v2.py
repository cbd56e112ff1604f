"""MiMo-V2 (MiMo-V2-Flash and the multimodal MiMo-V2) on 0.5.23: ``MiMoV2Model``
(mimo_v2.py).

Each decoder layer is an attention stage and an FFN stage on the layer boundaries
(``MiMoV2DecoderLayer``, pristine mimo_v2.py 854-1064): ``MiMoV2Attention`` (o_proj
``reduce_results=False``, 733), full or sliding-window per
``config.hybrid_layer_pattern`` (1 = sliding window, 1015-1016), and, per
``config.moe_layer_freq``, a dense ``MiMoV2MLP`` (built with ``reduce_results=False``,
937-945) or a ``MiMoV2MoE`` (its partial sum; ``ffn_exit.finish`` owns it, 999-1002).
The boundaries own every sum, so every stand-in is REDUCE_NONE.

Captures go into upstream's ``AuxHiddenStatePacker(len(self.layers_to_capture))``
(1154): ``attn_boundary.prepare(capture_gathered=...)`` of layer ``i`` for ``i in
layers_to_capture`` (984-988), and the last layer's output (capture index
``num_hidden_layers``) as a ``residual_batch.snapshot`` after the loop (1188-1195), or,
with 0038's ``post_norm``, the final norm's output. K of K, packed.

The tiny config keeps the checkpoint's shapes: layer 0 dense and full attention, the
rest MoE, sliding-window layers between full-attention ones (MiMo-V2-Flash's
``hybrid_layer_pattern``), SWA layers with head counts of their own.

``MiMoV2Model.forward`` returns ``(hidden_states, hidden_states_before_norm)`` without
captures and ``(hidden_states, hidden_states_before_norm, aux)`` with them (1210-1212;
``MiMoV2ForCausalLM.forward`` unpacks one or the other on ``capture_aux_hidden_states``,
pristine 1476-1479); the spec's ``run`` returns what the generic suites read, the final
hidden states and the captures (``(hidden_states, aux)``, or the bare hidden states
where the forward returned none).
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import layer_output, run_plain, standins


def _mimo_v2_config(tc):
    n = tc.num_layers
    # No config class in SGLang (mimo_v2.py: ``MiMoV2Config = None``; the checkpoint's
    # is trust_remote_code): a plain PretrainedConfig with the fields the model reads.
    return hf_config(
        tc,
        architectures=["MiMoV2FlashForCausalLM"],
        layernorm_epsilon=1e-6,
        # MiMo-V2-Flash: full attention at layer 0 and every fourth layer here, sliding
        # window between (1 = SWA, MiMoV2DecoderLayer.is_swa_layer).
        hybrid_layer_pattern=[0 if i % 4 == 0 else 1 for i in range(n)],
        sliding_window_size=8,
        swa_num_attention_heads=8,
        swa_num_key_value_heads=4,
        swa_head_dim=tc.hidden_size // 4,
        swa_rope_theta=10000.0,
        # Layer 0 dense, the rest MoE (is_moe_layer reads a per-layer list).
        moe_layer_freq=[0] + [1] * (n - 1),
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=tc.intermediate_size,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )


def _run(model, input_ids, positions, forward_batch, **inputs):
    """``MiMoV2Model.forward`` with the batch held for :func:`layer_output`; returns
    ``(hidden_states, aux)`` from its 3-tuple, the bare ``hidden_states`` from its
    2-tuple (no captures), as ``MiMoV2ForCausalLM.forward`` unpacks them."""
    out = run_plain(model, input_ids, positions, forward_batch, **inputs)
    if len(out) == 3:
        hidden_states, _before_norm, aux = out
        return hidden_states, aux
    hidden_states, _before_norm = out
    return hidden_states


SPECS = [
    ModelSpec(
        name="mimo_v2",
        module="sglang.srt.models.mimo_v2",
        model_cls="MiMoV2Model",
        standins={},
        build_patches=standins({
            # o_proj reduce_results=False (pristine mimo_v2.py 733); the decoder layer
            # reads nothing else from it. Full and sliding-window layers alike.
            "MiMoV2Attention": {},
            # The dense layer's MLP, reduce_results=False (944).
            "MiMoV2MLP": {},
            # The sparse layers' MoE: its partial sum (a MoeDeferredFinalize only under
            # the CuteDSL fusion, off here); ffn_exit.finish owns the sum.
            "MiMoV2MoE": {},
        }),
        config=_mimo_v2_config,
        # declare_ffn(sparse=..., next_layer_sparse=...) with no output transform and
        # no output_complete (964-974), as glm4_moe's and deepseek_v2's: the FFN sum
        # is owed past ffn_exit.finish and completed at the next layer's
        # attn_boundary.prepare (or the final norm) at TP > 1.
        defers=True,
        # G: a packer model whose packer is sized AuxHiddenStatePacker(len(
        # self.layers_to_capture)) (1154), never AuxHiddenStatePacker.for_batch (so a
        # DFlash decode graph's forward_batch.aux_hidden_states_buffer is not filled in
        # place), and MiMoV2ForCausalLM has no get_aux_hidden_states_width.
        # Not B (packs), not C (the last layer's snapshot after the loop), not T (TBO
        # only when nothing is captured, 1155). DFlash only (no EAGLE3 setter; the
        # model runner refuses EAGLE3 with one error): not a bug letter.
        pin_bugs=frozenset({"G"}),
        fixed_by={"G": "dsv2-mimo-aux-packer-shared"},
        layer_output=layer_output,
        run=_run,
        wraps=("mimo_v2.py: MiMoV2ForCausalLM (set_dflash_layers_to_capture only) and its "
               "subclass MiMoV2FlashForCausalLM",),
        note="attn_boundary.prepare(capture_gathered=packer) of layer i for i in "
        "layers_to_capture (pristine mimo_v2.py 984-988), and the last layer's output as "
        "a residual_batch.snapshot after the loop (1188-1195): K of K, packed by "
        "AuxHiddenStatePacker(len(layers_to_capture)) (1154). The forward returns a "
        "2-tuple without captures, a 3-tuple with them (1210-1212). "
        "set_dflash_layers_to_capture maps HF layer id k to capture index k + 1 "
        "(1501-1513); the spec sets MiMoV2Model.layers_to_capture (capture indices) "
        "directly.",
    ),
]
