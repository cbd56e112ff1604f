"""Nanbeige on 0.5.23: ``NanbeigeModel`` (nanbeige.py), a looped model.

The model runs its ``num_hidden_layers`` physical decoder layers ``num_loops`` times
and captures on *unrolled* ids: id ``loop_idx * num_hidden_layers + i`` is the stream
entering physical layer ``i`` in loop ``loop_idx``, and the last unrolled id
(``num_loops * num_hidden_layers``) the last layer's output in the last loop, taken at
the final norm. The generic suites' reference is a forward hook per layer *call*
(:func:`harness.suites.models.reference`), so on a looped model reference index
``k`` is the output of unrolled call ``k - 1``: the unrolled ids, provided the spec's
``tiny.num_layers`` is the unrolled depth (every layer set and the "last layer" id of
the suites are then unrolled ids, and the last one is the final norm's capture) and
the loop boundary adds nothing the hook does not see. Hence:

* ``num_hidden_layers = tiny.num_layers // NUM_LOOPS`` physical layers (``len(layers)``
  is half of ``tiny.num_layers``);
* ``skip_loop_final_norm=True``: between loops the model only folds the residual into
  the stream (``residual_batch.fold``), so the input of the first layer of the next
  loop equals the hook's snapshot of the previous call. With ``False`` (the config
  default) it also applies ``self.norm`` between loops, and capture id
  ``k * num_hidden_layers`` (0 < k < num_loops) is that norm's output (the next step's
  input, as the model defines its ids), which a per-call layer-output hook cannot
  express; that path is covered by the upstream template
  (harness/upstream/templates/0.5.23/nanbeige_aux_packer.py) and
  tests/patches/test_final_capture_new_models.py.
"""

from __future__ import annotations

from harness.standins.models import ModelSpec, hf_config
from harness.standins.v0_5_23.models import layer_output, run_plain, standins

NUM_LOOPS = 2


def _nanbeige_config(tc):
    from sglang.srt.configs import NanbeigeConfig

    if tc.num_layers % NUM_LOOPS:
        raise ValueError(f"tiny.num_layers {tc.num_layers} is the unrolled depth: "
                         f"a multiple of num_loops {NUM_LOOPS}")
    return hf_config(
        tc,
        NanbeigeConfig,
        num_hidden_layers=tc.num_layers // NUM_LOOPS,
        num_loops=NUM_LOOPS,
        skip_loop_final_norm=True,
        rms_norm_eps=1e-6,
    )


SPECS = [
    ModelSpec(
        name="nanbeige",
        module="sglang.srt.models.nanbeige",
        model_cls="NanbeigeModel",
        standins={},
        # REDUCE_NONE stand-ins: NanbeigeAttention's o_proj (nanbeige.py 156-163) and
        # NanbeigeMLP's down_proj (76-83) are built with reduce_results=False; the
        # decoder layer's attn_boundary.finish / ffn_boundary.finish own the sums. One
        # attention per physical layer serves every loop (its attn[loop_idx] is the
        # KV cache of that loop): the stand-in's weights are shared by the loops, as
        # the real ones are.
        build_patches=standins({"NanbeigeAttention": {}, "NanbeigeMLP": {}}),
        config=_nanbeige_config,
        # ffn_boundary.finish (declare_ffn(sparse=False), as llama's) leaves its sum
        # owed to the next attn_boundary.prepare at TP > 1; at a loop boundary
        # residual_batch.fold completes it unfused.
        defers=True,
        pin_bugs=frozenset({"B", "C"}),
        # B: the Nanbeige family of the 0.5.23 packer migration.
        fixed_by={"B": "nanbeige-aux-packer"},
        layer_output=layer_output,
        run=run_plain,
        wraps=("nanbeige.py: NanbeigeForCausalLM (DFlash setter only)",),
        note="0.5.23: looped (module docstring): capture_output=aux.capture at "
        "attn_boundary.prepare of the unrolled step loop_idx * num_hidden_layers + i "
        "(nanbeige.py 358-368); the last unrolled id is no layer's input and "
        "final_norm took no capture (383-389): K-1 of K, silently. Only a DFlash "
        "setter (ids + 1, unrolled); driven here by setting layers_to_capture.",
    ),
]
