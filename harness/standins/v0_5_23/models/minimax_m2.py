"""MiniMax M2 on 0.5.23: ``MiniMaxM2Model`` (minimax_m2.py).

The loop passes ``captured_last_layer_outputs=aux_hidden_states if i in
self.layers_to_capture`` (minimax_m2.py 980-1015) and the layer captures through
``attn_boundary.prepare(capture_gathered=...)`` (887-890), after the previous layer's
owed MoE sum is completed; ``final_norm`` without a capture: K-1 of K, silently.
Every layer is MoE and leaves its sum to the next layer's ``attn_boundary.prepare``.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec
from harness.standins.v0_5_23.models import layer_output, run_plain, standins
# The checkpoint shapes (HF configs) and helpers that do not depend on the base: the pin's.
from harness.standins.models.minimax_m2 import _config


SPECS = [
    ModelSpec(
        name="minimax_m2",
        module="sglang.srt.models.minimax_m2",
        model_cls="MiniMaxM2Model",
        standins={},
        build_patches=standins({
            # o_proj RowParallelLinear(reduce_results=False) (minimax_m2.py 696).
            "MiniMaxM2Attention": {},
            # block_sparse_moe: its experts' sum is left to ffn_boundary.finish.
            "MiniMaxM2MoE": {},
        }),
        config=_config,
        defers=True,
        pin_bugs=frozenset({"B", "C", "R"}),
        # B: the MiniMax-M2 family of the 0.5.23 packer migration.
        fixed_by={"B": "minimax-m2-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=("minimax_m2.py: MiniMaxM2ForCausalLM (set_eagle3_layers_to_capture only)",),
        note="capture_gathered through the boundary (after the owed sum: no bug A). Its "
        "TBO branch never runs: init_new_tbo raises NotImplementedError for "
        "MiniMaxM2DecoderLayer, capturing or not (no bug T).",
    ),
]
