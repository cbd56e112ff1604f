"""MiniMax M2: ``MiniMaxM2Model`` (minimax_m2.py).

Already captures through the communicator at the pin: the loop passes
``captured_last_layer_outputs=aux_hidden_states if i in self.layers_to_capture``
(minimax_m2.py:1179-1187) and the layer calls
``prepare_attn_and_capture_last_layer_outputs`` (993-1000), which completes the
previous layer's deferred all-reduce before it captures. Every layer is MoE and
defers its all-reduce; the last layer never defers (``is_last_layer``, 982).
"""

from __future__ import annotations

from harness.standins.models import REDUCE_DEFERABLE, REDUCE_NONE, ModelSpec, hf_config


def _config(tc):
    return hf_config(
        tc,
        architectures=["MiniMaxM2ForCausalLM"],
        num_local_experts=4,
        num_experts_per_tok=2,
        scoring_func="sigmoid",
        use_routing_bias=False,
        rotary_dim=tc.hidden_size // 8,
        use_qk_norm=False,
        qk_norm_type="per_layer",
    )


SPECS = [
    ModelSpec(
        name="minimax_m2",
        module="sglang.srt.models.minimax_m2",
        model_cls="MiniMaxM2Model",
        standins={
            # o_proj: RowParallelLinear(reduce_results=False) (minimax_m2.py:783-792);
            # the communicator's prepare_mlp all-reduces.
            "MiniMaxM2Attention": (REDUCE_NONE, {}),
            # forward_normal all-reduces unless should_skip_post_experts_all_reduce(
            # is_tp_path=True, use_reduce_scatter, should_allreduce_fusion) (585-591).
            "MiniMaxM2MoE": (REDUCE_DEFERABLE, {}),
        },
        config=_config,
        defers=True,
        pin_bugs=frozenset({"B", "C", "R"}),
        wraps=(
            "minimax_m2.py: MiniMaxM2ForCausalLM (set_eagle3_layers_to_capture only)",
        ),
        note=(
            "Communicator capture at the pin (post all-reduce, so no bug A). Its TBO "
            "branch (can_run_tbo, minimax_m2.py:1160-1169) never runs: "
            "OperationsStrategy.init_new_tbo raises NotImplementedError for this layer "
            "class, capturing or not (no bug T). A non-last PP rank's last layer can "
            "defer and ship a partial sum in PPProxyTensors."
        ),
    ),
]
