"""The DFlash setters 0.5.23's models-capture-setters adds have no pipeline-rank guard
(issue 28, bug 7).

DFlash requires pp_size 1 (``speculative_hook.py`` refuses more), so a guard that
returns on a rank that is not the last could never take effect; the setters copied one
from their EAGLE3 setters. Checked at the entry point the model runner calls, each real
CausalLM created without its __init__: a DFlash setter configures ``id + 1`` whatever
the pipeline group says, and an EAGLE3 setter it added keeps its file's guard.
"""

from __future__ import annotations

import importlib
import types

import pytest

pytestmark = [pytest.mark.bases("0.5.23"), pytest.mark.guards("models-capture-setters")]

LAYERS = 8
IDS = [0, 2, 4]
# (module, CausalLM, its language model class): the DFlash setters the patch adds with
# a guarded EAGLE3 setter beside them.
ADDED = [
    ("apertus", "ApertusForCausalLM", "ApertusModel"),
    ("arcee", "ArceeForCausalLM", "ArceeModel"),
    ("bailing_moe", "BailingMoEForCausalLM", "BailingMoEModel"),
    ("exaone_moe", "ExaoneMoEForCausalLM", "ExaoneMoEModel"),
    ("glm4", "Glm4ForCausalLM", "Glm4Model"),
    ("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeModel"),
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel"),
    ("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Model"),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Model"),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeModel"),
]
EAGLE3_ADDED = ("arcee", "glm4", "granitemoehybrid")


def _lm(module: str, cls: str, model_cls: str):
    from harness.suites.models import bare

    mod = importlib.import_module(f"sglang.srt.models.{module}")
    return bare(getattr(mod, cls),
                model=bare(getattr(mod, model_cls), layers_to_capture=[]),
                config=types.SimpleNamespace(num_hidden_layers=LAYERS),
                pp_group=types.SimpleNamespace(is_first_rank=True, is_last_rank=False),
                capture_aux_hidden_states=False)


@pytest.mark.parametrize("module, cls, model_cls", ADDED, ids=[m for m, _, _ in ADDED])
def test_dflash_setter_has_no_pipeline_guard(sglang_tp1, module, cls, model_cls):
    lm = _lm(module, cls, model_cls)
    lm.set_dflash_layers_to_capture(IDS)
    assert lm.model.layers_to_capture == [i + 1 for i in IDS] and lm.capture_aux_hidden_states


@pytest.mark.parametrize("module, cls, model_cls", [a for a in ADDED if a[0] in EAGLE3_ADDED],
                         ids=list(EAGLE3_ADDED))
def test_added_eagle3_setter_keeps_its_guard(sglang_tp1, module, cls, model_cls):
    lm = _lm(module, cls, model_cls)
    lm.set_eagle3_layers_to_capture(IDS)
    assert lm.model.layers_to_capture == [] and not lm.capture_aux_hidden_states
