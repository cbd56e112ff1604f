"""No silent shortfall under two-batch overlap (the pin's models-capture-no-shortfall,
0.5.23's models-capture-skips-tbo): a batch that can run TBO still gives K of K
captures equal to the reference.

The TBO executor here (``harness.suites.models._tbo_executor``) first computes SGLang's
own TBO plan for the layers (``OperationsStrategy.init_new_tbo``), so a layer class TBO
has no plan for is refused as on a GPU, then runs the layers in order with the same
math and, like the plan's operations, no captures. Survey bug "T" marks the models whose
TBO path TBO accepts (deepseek_v2's sparse layers, qwen3_moe's layers); without the
patch the captures of those layers are missing (or the model returns none at all). The
other models with a TBO branch never get to drop a capture: TBO refuses their layers,
capturing or not.
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

TBO_MODELS = sorted(n for n, s in specs().items() if "T" in s.bugs())
# Models whose forward has a TBO branch over layers TBO has no plan for.
TBO_REFUSED = ["glm4_moe", "glm4_moe_lite", "minimax_m2", "qwen2_moe"]


@pytest.mark.parametrize("layers_name", ["eagle3-default", "dflash"])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.guards(specs()[n].patch_for("T"))) for n in TBO_MODELS]
)
def test_two_batch_overlap_batch_captures_k_of_k(sglang_tp1, name, layers_name):
    layers = layer_sets(specs()[name].tiny.num_layers)[layers_name]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, tbo=True)
    assert res["num_captured"] == res["num_expected"], (
        f"{name}: captured {res['num_captured']} of {res['num_expected']} aux hidden states "
        f"in a batch that can run two-batch overlap ({res['tbo_layers']} layers overlapped)"
    )
    assert torch.equal(res["captures"], res["expected"])
    assert torch.equal(res["final"], res["reference_final"])
    assert res["tbo_layers"] == 0


def test_tbo_models_are_covered():
    assert TBO_MODELS == ["deepseek_v2", "qwen3_moe"]
    assert not set(TBO_REFUSED) & set(TBO_MODELS)


def _tbo_forward(name):
    from harness.suites.models import _forward, _tbo_executor, get_model, input_ids

    model = get_model(name)
    calls: list = []
    specs()[name].configure(model, [])
    with _tbo_executor(model, calls, enabled=True):
        _forward(model, input_ids(6, specs()[name].tiny.vocab_size), tbo=True)
    return calls


@pytest.mark.parametrize("name", TBO_MODELS)
def test_two_batch_overlap_still_runs_when_nothing_is_captured(sglang_tp1, name):
    assert sum(_tbo_forward(name)) > 0, f"{name}: a batch that captures nothing no longer overlaps"


@pytest.mark.parametrize("name", TBO_REFUSED)
def test_two_batch_overlap_refuses_these_layers(sglang_tp1, name):
    """SGLang's TBO plan has no strategy for these layer classes: the TBO executor
    raises for any batch that can run TBO, as it does on a GPU."""
    with pytest.raises(NotImplementedError):
        _tbo_forward(name)



@pytest.mark.guards(specs()["deepseek_v2"].patch_for("T"))
@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_model_runner_says_two_batch_overlap_is_off_while_capturing(sglang_tp1, caplog, algorithm):
    """With --enable-two-batch-overlap, the model runner says once, when it sets up the
    captures, that capturing batches run without overlap (the pin's
    ``ModelRunner.init_aux_hidden_state_capture``, 0.5.23's
    ``configure_aux_hidden_state_capture``)."""
    import importlib.util
    import logging
    from types import SimpleNamespace
    from unittest import mock

    import torch

    class _Model(torch.nn.Module):
        def set_eagle3_layers_to_capture(self, layer_ids):
            self.ids = layer_ids

        set_dflash_layers_to_capture = set_eagle3_layers_to_capture

    flags = dict(eagle_use_aux_hidden_state=algorithm == "eagle3",
                 eagle_aux_hidden_state_layer_ids=[1, 2],
                 dflash_use_aux_hidden_state=algorithm == "dflash", dflash_target_layer_ids=[1, 2])
    setup_mod = "sglang.srt.model_executor.model_runner_components.attention_backend_setup"

    def setup(tbo: bool):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sglang"):
            if importlib.util.find_spec("sglang.srt.model_executor.model_runner_components") is None:
                from sglang.srt.model_executor.model_runner import ModelRunner

                # final_layer_capture, deepstack_capture: what ModelRunner.__init__
                # resolves (pin 0016, 0017); model_config: the target's layer count
                ModelRunner.init_aux_hidden_state_capture(SimpleNamespace(
                    model=_Model(), server_args=SimpleNamespace(enable_two_batch_overlap=tbo),
                    model_config=SimpleNamespace(num_hidden_layers=4),
                    final_layer_capture="pre_norm", deepstack_capture=None, **flags))
            else:
                setup = importlib.import_module(setup_mod)
                overlap = SimpleNamespace(overlap=SimpleNamespace(enable_two_batch_overlap=tbo))
                with mock.patch.object(setup, "get_exec", lambda: overlap):
                    setup.configure_aux_hidden_state_capture(model=_Model(), is_dspark=False,
                                                             **flags)
        return [r.getMessage() for r in caplog.records if "two-batch-overlap" in r.getMessage()]

    said = setup(tbo=True)
    assert len(said) == 1, f"expected one message about --enable-two-batch-overlap, got {said}"
    assert "without overlap" in said[0] and "EAGLE3/DFlash" in said[0]
    assert setup(tbo=False) == []
