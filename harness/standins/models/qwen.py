"""Qwen family: ``Qwen2Model`` (qwen2.py), ``Qwen3Model`` (qwen3.py), ``Qwen2MoeModel``
(qwen2_moe.py), ``Qwen3MoeModel`` (qwen3_moe.py), ``Qwen3LLMModel`` (qwen3_vl.py) and
``Qwen3MoeLLMModel`` (qwen3_vl_moe.py).

Two capture mechanisms at the pin:

* list membership at the top of the decoder loop (``if i in self.layers_to_capture:
  aux.append(hidden_states + residual)``): Qwen2Model.forward (also run by Qwen3Model),
  Qwen3LLMModel.forward and Qwen3MoeLLMModel.forward;
* per-layer ``_is_layer_to_capture`` flags, set by the model's
  ``set_eagle3_layers_to_capture`` / ``set_dflash_layers_to_capture`` (a ``setattr`` on
  ``self.layers[layer_id]``), with the capture taken in the communicator
  (``prepare_attn_and_capture_last_layer_outputs``): Qwen2MoeModel.forward (also run by
  Qwen3MoeModel).

The VL language models live in one module and their decoder layers in another
(qwen3_vl -> qwen3.Qwen3DecoderLayer, qwen3_vl_moe -> qwen3_moe.Qwen3MoeDecoderLayer), so
their stand-ins are installed in the layer's module through ``build_patches``.
"""

from __future__ import annotations

from harness.standins.blocks import TinyConfig
from harness.standins.models import (
    REDUCE_DEFERABLE,
    REDUCE_NONE,
    REDUCE_SELF,
    ModelSpec,
    hf_config,
)

_TINY = TinyConfig()

# Stand-ins of qwen3.py (dense Qwen3 layers):
#   Qwen3Attention.o_proj: RowParallelLinear(reduce_results=False) (qwen3.py:129-138);
#     the LayerCommunicator's prepare_mlp all-reduces.
#   Qwen3MLP is qwen2.Qwen2MLP (qwen3.py:31): down_proj RowParallelLinear with the default
#     reduce_results=True (qwen2.py:81-87), so it all-reduces itself.
_QWEN3_STANDINS = {"Qwen3Attention": (REDUCE_NONE, {}), "Qwen3MLP": (REDUCE_SELF, {})}

# Stand-ins of qwen3_moe.py:
#   Qwen3MoeAttention.o_proj: RowParallelLinear(reduce_results=False) (qwen3_moe.py:502-511);
#     the communicator reduces.
#   Qwen3MoeSparseMoeBlock.forward(hidden_states, forward_batch, should_allreduce_fusion,
#     use_reduce_scatter) all-reduces unless should_skip_post_experts_all_reduce(...)
#     (forward_normal, qwen3_moe.py:334-348): deferred when the layer fuses the all-reduce
#     into the next layer's norm (Qwen3MoeDecoderLayer.forward passes the flag, 841-857).
_QWEN3_MOE_STANDINS = {
    "Qwen3MoeAttention": (REDUCE_NONE, {}),
    "Qwen3MoeSparseMoeBlock": (REDUCE_DEFERABLE, {}),
}


def _patches_in(module_name: str, standins: dict, tc: TinyConfig = _TINY):
    """``build_patches`` that installs stand-ins in another module (where the decoder
    layer class looks them up)."""

    def build_patches(_mod):
        import importlib

        from harness.standins.blocks import standin_class

        other = importlib.import_module(module_name)
        return [
            (other, name, standin_class(getattr(other, name), tc, reduce, dict(attrs or {})))
            for name, (reduce, attrs) in standins.items()
        ]

    return build_patches


def _keyword_construct(cls, config):
    # Qwen3LLMModel / Qwen3MoeLLMModel take keyword-only arguments.
    return cls(config=config, quant_config=None)


def _configure_flags(model, indices):
    """The flag-based models: clear every layer's ``_is_layer_to_capture`` (the pin's
    setters never clear stale flags), then call the model's own setter with the
    already-mapped ids, as ``Qwen2MoeForCausalLM.set_eagle3_layers_to_capture`` /
    ``Qwen3MoeForCausalLM.set_*_layers_to_capture`` do. At the pin the setter's
    ``setattr(self.layers[layer_id], ...)`` raises IndexError for ``end_layer``
    (bug C as a crash)."""
    for layer in model.layers:
        if "_is_layer_to_capture" in layer.__dict__:
            del layer.__dict__["_is_layer_to_capture"]
    model.layers_to_capture = []
    model.set_eagle3_layers_to_capture(list(indices))


# ---------------------------------------------------------------- configs


def _qwen2_config(tc):
    from transformers import Qwen2Config

    return hf_config(tc, Qwen2Config)


def _qwen3_config(tc):
    from transformers import Qwen3Config

    return hf_config(tc, Qwen3Config)


def _moe_fields(tc):
    return dict(
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=tc.intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _qwen2_moe_config(tc):
    from transformers import Qwen2MoeConfig

    return hf_config(
        tc,
        Qwen2MoeConfig,
        shared_expert_intermediate_size=tc.intermediate_size,
        qkv_bias=True,
        **_moe_fields(tc),
    )


def _qwen3_moe_config(tc):
    from transformers import Qwen3MoeConfig

    return hf_config(tc, Qwen3MoeConfig, **_moe_fields(tc))


def _qwen3_vl_config(tc):
    # Qwen3LLMModel.__init__ reads config.vision_config.deepstack_visual_indexes
    # (qwen3_vl.py:978-987); the real wrapper passes the whole Qwen3VLConfig.
    from sglang.srt.configs.qwen3_vl import Qwen3VLTextConfig, Qwen3VLVisionConfig

    config = hf_config(tc, Qwen3VLTextConfig)
    config.vision_config = Qwen3VLVisionConfig(deepstack_visual_indexes=[1, 2, 3])
    return config


def _qwen3_vl_moe_config(tc):
    # The wrapper passes config.text_config (qwen3_vl.py, language_model_cls branch);
    # Qwen3MoeLLMModel needs no vision_config (deepstack range(3) is hard-coded).
    from sglang.srt.configs.qwen3_vl import Qwen3VLMoeTextConfig

    return hf_config(tc, Qwen3VLMoeTextConfig, **_moe_fields(tc))


SPECS = [
    ModelSpec(
        name="qwen2",
        module="sglang.srt.models.qwen2",
        model_cls="Qwen2Model",
        standins={
            # o_proj: RowParallelLinear with the default reduce_results=True (qwen2.py:159-165).
            "Qwen2Attention": (REDUCE_SELF, {}),
            # down_proj: RowParallelLinear, default reduce_results=True (qwen2.py:81-87).
            "Qwen2MLP": (REDUCE_SELF, {}),
        },
        config=_qwen2_config,
        pin_bugs=frozenset({"B", "C", "R"}),
        wraps=(
            "qwen2.py: Qwen2ForCausalLM",
            "qwen2_5_vl.py: Qwen2_5_VLForConditionalGeneration (self.model = Qwen2Model)",
        ),
        note="Top-of-loop capture hidden_states + residual (qwen2.py:370-374); no "
        "communicator, nothing defers. No set_dflash_layers_to_capture.",
    ),
    ModelSpec(
        name="qwen3",
        module="sglang.srt.models.qwen3",
        model_cls="Qwen3Model",
        standins=_QWEN3_STANDINS,
        config=_qwen3_config,
        pin_bugs=frozenset({"B", "C"}),
        wraps=("qwen3.py: Qwen3ForCausalLM",),
        note="Runs Qwen2Model.forward (top-of-loop capture, qwen2.py:370-374) over "
        "Qwen3DecoderLayer with a LayerCommunicator that never defers (Qwen3MLP "
        "all-reduces itself).",
    ),
    ModelSpec(
        name="qwen2_moe",
        module="sglang.srt.models.qwen2_moe",
        model_cls="Qwen2MoeModel",
        standins={
            # o_proj: RowParallelLinear(reduce_results=False) (qwen2_moe.py:599-608);
            # the communicator's prepare_mlp / postprocess_layer reduce.
            "Qwen2MoeAttention": (REDUCE_NONE, {}),
            # forward(hidden_states, forward_batch, use_reduce_scatter,
            # should_allreduce_fusion): tensor_model_parallel_all_reduce unless
            # should_skip_post_experts_all_reduce(...) (qwen2_moe.py:530-539). The decoder
            # passes only use_reduce_scatter (positional), never the fusion flag.
            "Qwen2MoeSparseMoeBlock": (REDUCE_DEFERABLE, {}),
        },
        config=_qwen2_moe_config,
        configure=_configure_flags,
        pin_bugs=frozenset({"B", "C", "R", "L"}),
        wraps=("qwen2_moe.py: Qwen2MoeForCausalLM",),
        note="Communicator capture through per-layer _is_layer_to_capture flags "
        "(qwen2_moe.py:876-886); set_eagle3_layers_to_capture's setattr raises "
        "IndexError for end_layer (823-826). Layers never defer. TBO refuses "
        "Qwen2MoeDecoderLayer (init_new_tbo raises NotImplementedError), so its TBO "
        "branch only runs for qwen3_moe's layers (bug T there); CP captures are never "
        "gathered.",
    ),
    ModelSpec(
        name="qwen3_moe",
        module="sglang.srt.models.qwen3_moe",
        model_cls="Qwen3MoeModel",
        standins=_QWEN3_MOE_STANDINS,
        config=_qwen3_moe_config,
        configure=_configure_flags,
        defers=True,
        pin_bugs=frozenset({"B", "C", "T", "L"}),
        wraps=(
            "qwen3_moe.py: Qwen3MoeForCausalLM",
            "qwen3_vl_moe.py: Qwen3MoeLLMModel subclasses it but overrides forward "
            "(its own spec)",
        ),
        note="Runs Qwen2MoeModel.forward (flag-based communicator capture, taken after "
        "prepare_attn's deferred all-reduce: no bug A). Qwen3MoeDecoderLayer defers its "
        "MoE all-reduce except on the last layer (is_last_layer). Both "
        "set_eagle3_layers_to_capture (qwen2_moe.py:823-826) and "
        "set_dflash_layers_to_capture (qwen3_moe.py:936-939) setattr per layer and raise "
        "IndexError for end_layer; the hook calls the eagle3 one (same body). TBO runs "
        "every layer without captures.",
    ),
    ModelSpec(
        name="qwen3_vl",
        module="sglang.srt.models.qwen3_vl",
        model_cls="Qwen3LLMModel",
        standins={},
        build_patches=_patches_in("sglang.srt.models.qwen3", _QWEN3_STANDINS),
        config=_qwen3_vl_config,
        construct=_keyword_construct,
        pin_bugs=frozenset({"B", "C", "R", "V"}),
        wraps=(
            "qwen3_vl.py: Qwen3VLForConditionalGeneration",
        ),
        note="Own forward (qwen3_vl.py:1001-1072): top-of-loop capture before deepstack "
        "(post_residual_addition). Driven without images (no deepstack). The wrapper's "
        "set_dflash_layers_to_capture calls a method Qwen3LLMModel lacks (AttributeError).",
    ),
    ModelSpec(
        name="qwen3_vl_moe",
        module="sglang.srt.models.qwen3_vl_moe",
        model_cls="Qwen3MoeLLMModel",
        standins={},
        build_patches=_patches_in("sglang.srt.models.qwen3_moe", _QWEN3_MOE_STANDINS),
        config=_qwen3_vl_moe_config,
        construct=_keyword_construct,
        defers=True,
        pin_bugs=frozenset({"A", "B", "C", "V"}),
        wraps=(
            "qwen3_vl_moe.py: Qwen3VLMoeForConditionalGeneration",
        ),
        note="Own forward (qwen3_vl_moe.py:77-147): top-of-loop capture "
        "hidden_states + residual after a Qwen3MoeDecoderLayer that deferred its "
        "all-reduce (bug A). Driven without images (no deepstack). EAGLE3 sets the list "
        "(silent K-1); DFLASH goes to Qwen3MoeModel.set_dflash_layers_to_capture "
        "(IndexError for end_layer).",
    ),
]
