# upstream-path: test/registered/unit/models/test_aux_capture_setters.py
"""Every capturing model has the setters the model runner calls.

The model runner requests EAGLE3/DFlash captures with
``configure_aux_hidden_state_capture``, which calls the model's
``set_eagle3_layers_to_capture`` or ``set_dflash_layers_to_capture`` and
raises when the one it needs is missing. Models whose forward captures and
hands the captures to the logits processor lacked the DFlash setter (or,
for arcee, glm4 and granitemoehybrid, both), and the Qwen3-VL wrapper's
DFlash setter called one its dense language model does not have. Each
setter must request capture index ``id + 1`` (the output of layer ``id``)
from the language model and turn on ``capture_aux_hidden_states``. An added
EAGLE3 setter skips a pipeline rank that is not the last, as its file's
others do; an added DFlash setter has no such guard, since DFlash requires
pp_size 1.

Runs on CPU without a GPU or a checkpoint: each model, and the language
model it wraps, is its real class created without its __init__ (which
would build the weights), given only the attributes the setters read: the
pipeline group, the config (for EAGLE3's default layers), the language
model, and its capture list, empty at first. The setters are the real
ones, called through configure_aux_hidden_state_capture as the model
runner does, with the server args published.
"""

import dataclasses
import types
import unittest
from typing import Optional

from torch import nn

from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
    configure_aux_hidden_state_capture,
)
from sglang.srt.models.apertus import ApertusForCausalLM, ApertusModel
from sglang.srt.models.arcee import ArceeForCausalLM, ArceeModel
from sglang.srt.models.bailing_moe import BailingMoEForCausalLM, BailingMoEModel
from sglang.srt.models.exaone_moe import ExaoneMoEForCausalLM, ExaoneMoEModel
from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM, Gemma3TextModel
from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration
from sglang.srt.models.glm4 import Glm4ForCausalLM, Glm4Model
from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeModel
from sglang.srt.models.granitemoehybrid import (
    GraniteMoeHybridForCausalLM,
    GraniteMoeHybridModel,
)
from sglang.srt.models.llama4 import Llama4ForCausalLM, Llama4Model
from sglang.srt.models.longcat_flash import LongcatFlashForCausalLM, LongcatFlashModel
from sglang.srt.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2Model
from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration
from sglang.srt.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeModel
from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration
from sglang.srt.models.qwen3_vl_moe import (
    Qwen3MoeLLMModel,
    Qwen3VLMoeForConditionalGeneration,
)
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

NUM_LAYERS = 8
DFLASH_LAYER_IDS = [0, 2, 4]
EAGLE3_LAYER_IDS = [1, 3]


@dataclasses.dataclass
class _Case:
    """A model class and the class of the language model it captures from.

    ``wraps``: the causal LM a multimodal wrapper delegates to (None when the
    model holds the language model itself). ``eagle3_added``: the model had
    no EAGLE3 setter either. ``dflash_added``: this change adds the DFlash
    setter that runs (not a wrapper's delegation to an existing one).
    """

    model_cls: type
    language_model_cls: type
    wraps: Optional[type] = None
    eagle3_added: bool = False
    dflash_added: bool = True

    @property
    def name(self):
        return self.model_cls.__name__


CASES = (
    _Case(ApertusForCausalLM, ApertusModel),
    _Case(ArceeForCausalLM, ArceeModel, eagle3_added=True),
    _Case(BailingMoEForCausalLM, BailingMoEModel),
    _Case(ExaoneMoEForCausalLM, ExaoneMoEModel),
    _Case(Gemma3ForCausalLM, Gemma3TextModel),
    _Case(Gemma3ForConditionalGeneration, Gemma3TextModel, wraps=Gemma3ForCausalLM),
    _Case(Glm4ForCausalLM, Glm4Model, eagle3_added=True),
    _Case(Glm4MoeForCausalLM, Glm4MoeModel),
    _Case(GraniteMoeHybridForCausalLM, GraniteMoeHybridModel, eagle3_added=True),
    _Case(LongcatFlashForCausalLM, LongcatFlashModel),
    _Case(MiniMaxM2ForCausalLM, MiniMaxM2Model),
    # Delegates to LlamaForCausalLM's own DFlash setter.
    _Case(
        Llama4ForConditionalGeneration,
        Llama4Model,
        wraps=Llama4ForCausalLM,
        dflash_added=False,
    ),
    _Case(Qwen2ForCausalLM, Qwen2Model),
    _Case(Qwen2_5_VLForConditionalGeneration, Qwen2Model),
    _Case(Qwen2MoeForCausalLM, Qwen2MoeModel),
    # The wrapper's own DFlash setter, fixed: the dense language model has
    # no DFlash setter; the MoE one has.
    _Case(Qwen3VLForConditionalGeneration, Qwen3LLMModel, dflash_added=False),
    _Case(Qwen3VLMoeForConditionalGeneration, Qwen3MoeLLMModel, dflash_added=False),
)


def _bare(cls, pp_group):
    """``cls`` without its __init__, with what every setter may read: the
    pipeline group, and the config for the EAGLE3 default layers."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    module.pp_group = pp_group
    module.config = types.SimpleNamespace(num_hidden_layers=NUM_LAYERS)
    return module


def _causal_lm(cls, language_model_cls, pp_group):
    model = _bare(cls, pp_group)
    model.capture_aux_hidden_states = False
    language_model = _bare(language_model_cls, pp_group)
    # What the language model's __init__ sets: its layers (stand-ins, for a
    # setter that walks them) and an empty capture list.
    language_model.layers = nn.ModuleList(nn.Identity() for _ in range(NUM_LAYERS))
    language_model.layers_to_capture = []
    model.model = language_model
    return model, model, language_model


def _build(case, last_rank=True):
    """(model, the module whose forward reads capture_aux_hidden_states, the
    language model whose forward reads layers_to_capture)."""
    pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=last_rank)
    if case.wraps is None:
        return _causal_lm(case.model_cls, case.language_model_cls, pp_group)
    model = _bare(case.model_cls, pp_group)
    model.language_model, holder, language_model = _causal_lm(
        case.wraps, case.language_model_cls, pp_group
    )
    return model, holder, language_model


def _configure(model, method, layer_ids):
    """What the model runner does for an EAGLE3 or a DFlash draft model; the
    setters that read the pipeline group from the runtime see the model's."""
    with get_parallel().override(pp_group=model.pp_group):
        configure_aux_hidden_state_capture(
            model=model,
            eagle_use_aux_hidden_state=method == "eagle3",
            eagle_aux_hidden_state_layer_ids=layer_ids,
            dflash_use_aux_hidden_state=method == "dflash",
            dflash_target_layer_ids=layer_ids,
            is_dspark=False,
        )


class TestModelsCaptureSetters(CustomTestCase):
    def setUp(self):
        # The model runner configures the captures once the server args are
        # published.
        server_args = get_context().override_server_args()
        server_args.install()
        self.addCleanup(server_args.restore)

    def _check_requested(self, case, method, layer_ids, expected):
        model, holder, language_model = _build(case)
        _configure(model, method, layer_ids)
        self.assertEqual(language_model.layers_to_capture, expected)
        self.assertTrue(holder.capture_aux_hidden_states)

    def test_dflash(self):
        # Capture index i is the input of layer i: layer id j -> j + 1.
        expected = [i + 1 for i in DFLASH_LAYER_IDS]
        for case in CASES:
            with self.subTest(model=case.name):
                self._check_requested(case, "dflash", DFLASH_LAYER_IDS, expected)

    def test_eagle3_where_added(self):
        cases = [case for case in CASES if case.eagle3_added]
        self.assertEqual(len(cases), 3)
        expected = [i + 1 for i in EAGLE3_LAYER_IDS]
        for case in cases:
            with self.subTest(model=case.name, layer_ids=EAGLE3_LAYER_IDS):
                self._check_requested(case, "eagle3", EAGLE3_LAYER_IDS, expected)
            # Without ids from the draft model: the usual low, middle and
            # high layers.
            expected_default = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]
            with self.subTest(model=case.name, layer_ids=None):
                self._check_requested(case, "eagle3", None, expected_default)

    def test_dflash_requires_layer_ids(self):
        for case in CASES:
            with self.subTest(model=case.name):
                model, holder, language_model = _build(case)
                with self.assertRaisesRegex(ValueError, "explicit layer_ids"):
                    _configure(model, "dflash", None)
                self.assertEqual(language_model.layers_to_capture, [])
                self.assertFalse(holder.capture_aux_hidden_states)

    def test_added_eagle3_setters_skip_a_pipeline_rank_not_the_last(self):
        for case in CASES:
            if not case.eagle3_added:
                continue
            with self.subTest(model=case.name):
                model, holder, language_model = _build(case, last_rank=False)
                _configure(model, "eagle3", EAGLE3_LAYER_IDS)
                self.assertEqual(language_model.layers_to_capture, [])
                self.assertFalse(holder.capture_aux_hidden_states)

    def test_added_dflash_setters_have_no_pipeline_guard(self):
        # DFlash requires pp_size 1: a guard on the pipeline rank could never
        # take effect, so the added setters configure whatever it says.
        expected = [i + 1 for i in DFLASH_LAYER_IDS]
        for case in CASES:
            if not case.dflash_added:
                continue
            with self.subTest(model=case.name):
                model, holder, language_model = _build(case, last_rank=False)
                _configure(model, "dflash", DFLASH_LAYER_IDS)
                self.assertEqual(language_model.layers_to_capture, expected)
                self.assertTrue(holder.capture_aux_hidden_states)


if __name__ == "__main__":
    unittest.main()
