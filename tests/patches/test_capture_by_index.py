"""The models that flagged layers capture by ``layers_to_capture`` alone.

qwen2_moe (also run by qwen3_moe), qwen3_next and qwen3_5 kept two records of what
to capture: their setters set the list and flagged each layer, and the forward
captured in the loop by the flags but the last layer by the list. The Qwen3-VL wrapper
that real Qwen3.5 checkpoints are served through sets only its language model's list
(``Qwen3VLForConditionalGeneration.set_eagle3_layers_to_capture``). Here every such
model gets its captures requested that way: the list alone, no flag. Each must return
K of K, equal to the reference (the layers' complete outputs, taken with hooks).
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _params():
    out = []
    for name, spec in sorted(specs().items()):
        if "L" not in spec.bugs():
            continue
        patch = spec.patch_for("L")
        marks = [pytest.mark.guards(patch)] if patch else [
            pytest.mark.skip(reason="bug 'L' is not fixed by this base's series (docs/MODELS.md)")]
        for set_name in ("eagle3-default", "eagle3-last"):
            out.append(pytest.param(name, set_name, id=f"{name}-{set_name}", marks=marks))
    return out


@pytest.mark.parametrize("name, set_name", _params())
def test_list_alone_captures_k_of_k(sglang_tp1, name, set_name):
    spec = specs()[name]
    layers = layer_sets(spec.tiny.num_layers)[set_name]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, list_only=True)
    assert res["num_captured"] == res["num_expected"], (
        f"{name}: layers_to_capture={layers} set alone gave {res['num_captured']} of "
        f"{res['num_expected']} aux hidden states"
    )
    assert torch.equal(res["captures"], res["expected"]), (
        f"{name}: captures differ from the layers' outputs"
    )


@pytest.mark.bases("0.5.23")
@pytest.mark.guards("models-capture-by-index")
def test_no_forward_under_the_list_setters_reads_a_flag(sglang_tp1):
    """The setters flag no layer any more, so a forward that still reads the flag
    captures nothing in its loop. 0.5.23 adds forwards of their own that run under
    these models' setters (interns2_mobius and qwen4_exp subclass Qwen3_5ForCausalLM):
    each must read the list too. A check of the forwards' source: Qwen4ExpModel's
    hyper-connection and PLE stack has no CPU stand-in to run it on."""
    import importlib
    import inspect

    names = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5", "interns2_mobius", "qwen4_exp")
    mods = [importlib.import_module(f"sglang.srt.models.{m}") for m in names]
    bases = (mods[0].Qwen2MoeModel, mods[2].Qwen3NextModel, mods[3].Qwen3_5ForCausalLM)
    forwards = [cls for mod in mods for cls in vars(mod).values()
                if inspect.isclass(cls) and issubclass(cls, bases)
                and cls.__module__ == mod.__name__ and "forward" in vars(cls)]
    assert {c.__name__ for c in forwards} >= {"Qwen3_5ForCausalLM", "Qwen4ExpModel",
                                               "InternS2MobiusForCausalLM"}, forwards
    readers = [f"{c.__module__}.{c.__qualname__}" for c in forwards
               if "_is_layer_to_capture" in inspect.getsource(c.forward)]
    assert not readers, f"forwards that still read the layer flag: {readers}"
