"""One warning wherever a ``post_norm`` final-layer capture is asked for and cannot
apply (the pin's and 0.5.23's post-norm-ignored-warning).

``post_norm`` changes only a capture of the target's last layer. Where there is none
(an algorithm that hands its draft no aux hidden states, an EAGLE3 draft with
``use_aux_hidden_state: false``, ids without the last layer, a model whose captures
are taken outside SGLang's model code) it used to be dropped without a word. Checked
at the entry points the engine calls: the server arguments' check, and the model
runner's start-up function (``harness.parity.runner.request_captures``) on SGLang's
real ``LlamaForCausalLM`` setters over a tiny real ``LlamaModel`` of 8 layers.
"""

from __future__ import annotations

import logging

import pytest

from harness.parity.runner import request_captures

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")
GUARD = pytest.mark.guards("post-norm-ignored-warning")
# tiny_llama_lm's layers (tests/patches/conftest.py): deep enough that EAGLE3's default
# ids [2, L // 2, L - 3] = [2, 4, 5] name distinct layers, none the last.
NUM_LAYERS = 8


@pytest.fixture(autouse=True)
def _process_setting_restored():
    """On the pin the start-up sets this process's final-layer capture (a module global,
    the model runner's setting for its target): put the default back, so a later test
    in this worker (a TP 1 reference computed here) does not run with post_norm. 0.5.23's
    series holds it on the configured model, so there is nothing to put back."""
    yield
    import inspect

    from sglang.srt.layers.aux_hidden_states import set_final_layer_capture

    if len(inspect.signature(set_final_layer_capture).parameters) == 1:
        set_final_layer_capture("pre_norm")


def _ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "final_layer_capture='post_norm' is ignored" in r.getMessage()]


def _start_up(caplog, model, **request) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        request_captures(model, final_layer_capture="post_norm", **request)
    return _ignored(caplog)


@GUARD
@pytest.mark.parametrize("request_, why", [
    ({}, "the draft takes no aux hidden states (use_aux_hidden_state: false)"),
    ({"eagle3": "default"}, "the draft's layer ids the default [2, L // 2, L - 3] do not "
                            "include the target's last layer (7)"),
    ({"eagle3": [0, 1, 2]}, "the draft's layer ids [0, 1, 2] do not include the target's "
                            "last layer (7)"),
    ({"dflash": [0, 2]}, "the draft's layer ids [0, 2] do not include the target's last "
                         "layer (7)"),
], ids=["no-aux", "eagle3-default", "eagle3-without-last", "dflash-without-last"])
def test_draft_without_a_last_layer_capture_warns_once(tiny_llama_lm, caplog, request_, why):
    warned = _start_up(caplog, tiny_llama_lm, **request_)
    assert len(warned) == 1, warned
    assert why in warned[0], warned[0]
    assert "\n" not in warned[0]


@GUARD
def test_model_without_captures_of_its_own_warns(caplog):
    """A model whose captures are taken outside SGLang's model code (the pin's
    MindSporeForCausalLM hands them to sgl_mindspore's model): no module of it keeps
    ``layers_to_capture``."""
    import torch

    class External(torch.nn.Module):
        config = type("C", (), {"num_hidden_layers": NUM_LAYERS})()

        def set_eagle3_layers_to_capture(self, layer_ids=None):
            self.requested = layer_ids

    model = External()
    warned = _start_up(caplog, model, eagle3=[0, 1, NUM_LAYERS - 1])
    assert model.requested == [0, 1, NUM_LAYERS - 1]
    assert len(warned) == 1 and "External keeps no layers_to_capture" in warned[0], warned


@pytest.mark.parametrize("request_", [{"eagle3": [0, 1, NUM_LAYERS - 1]},
                                      {"dflash": [1, NUM_LAYERS - 1]}],
                         ids=["eagle3-with-last", "dflash-with-last"])
def test_no_warning_where_post_norm_applies(tiny_llama_lm, caplog, request_):
    """(No regression test: true without the warning too.)"""
    assert _start_up(caplog, tiny_llama_lm, **request_) == []


@pytest.mark.bases("0.5.23")
@pytest.mark.parametrize("ids, why", [
    pytest.param([0, 2], "the draft's layer ids [0, 2] do not include the target's last "
                 "layer (7)", marks=GUARD),
    # (No regression test: true without the warning too. It fails where the check
    # looks for layers_to_capture alone: "KimiLinearModel keeps no layers_to_capture".)
    pytest.param([1, NUM_LAYERS - 1], None),
], ids=["dspark-without-last", "dspark-with-last"])
def test_dspark_ids_kept_outside_layers_to_capture(tiny_kimi_linear_lm, caplog, ids, why):
    """kimi_linear keeps a DSpark draft's ids in ``dspark_layers_to_capture`` (as kimi_k3
    and deepseek_v4 do) and honours ``post_norm``: warned only where the ids lack the
    last layer, never as a model whose captures are taken outside its code."""
    warned = _start_up(caplog, tiny_kimi_linear_lm, dflash=ids, dspark=True)
    assert tiny_kimi_linear_lm.model.dspark_layers_to_capture == ids
    if why is None:
        assert warned == []
    else:
        assert len(warned) == 1 and why in warned[0], warned


@GUARD
@pytest.mark.parametrize("algorithm", [None, "NEXTN"])
def test_server_arguments_warn_for_an_algorithm_without_aux_states(sglang_tp1, caplog, algorithm):
    """``--speculative-final-layer-capture post_norm`` with an algorithm that hands its
    draft no aux hidden states: checked where the server arguments are checked."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _check_server_args(speculative_final_layer_capture="post_norm",
                           speculative_algorithm=algorithm)
    warned = _ignored(caplog)
    assert len(warned) == 1, warned
    assert f"--speculative-algorithm {algorithm} hands its draft no aux hidden states" in warned[0]


@pytest.mark.parametrize("algorithm", ["EAGLE3", "DFLASH"])
def test_server_arguments_quiet_for_eagle3_and_dflash(sglang_tp1, caplog, algorithm):
    """(No regression test: true without the warning too.)"""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _check_server_args(speculative_final_layer_capture="post_norm",
                           speculative_algorithm=algorithm)
    assert _ignored(caplog) == []


def _check_server_args(**fields) -> None:
    """The base's ``ServerArgs.check_server_args`` (what the Engine calls) on real server
    arguments with these fields. The capture settings are checked early; later checks
    read fields the Engine fills before it checks (``chunked_prefill_size``, ...), so
    the call stops there with an error of their own, after the capture checks ran."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", served_model_name="dummy",
                             **fields)
    try:
        server_args.check_server_args()
    except (TypeError, AttributeError, AssertionError):
        pass
