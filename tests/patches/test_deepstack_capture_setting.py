"""The deepstack capture setting (the pin's deepstack-capture-setting, 0.5.23's
qwen3-vl-deepstack-capture) at the entry points the engine calls: the server argument's
CLI parser, the resolution the model runner does with the draft config, and the
function that hands the setting to the model at start-up (the pin's
``ModelRunner.init_aux_hidden_state_capture``, 0.5.23's
``configure_aux_hidden_state_capture``). The captures each value gives are checked
against transformers in tests/parity/test_deepstack.py."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest

SETTING_PATCH = {"0.5.13.post1": "deepstack-capture-setting",
                 "0.5.23": "qwen3-vl-deepstack-capture"}


def _guard():
    from harness.patchset.layout import layout

    return pytest.mark.guards(SETTING_PATCH[layout().label])


pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), _guard()]

VALUES = ("pre_deepstack", "post_deepstack")


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("value", VALUES)
def test_server_argument_parses(sglang_tp1, value):
    args = _parser().parse_args(["--model-path", "m", "--speculative-deepstack-capture", value])
    assert args.speculative_deepstack_capture == value


def test_server_argument_defaults_to_the_draft_config(sglang_tp1):
    args = _parser().parse_args(["--model-path", "m"])
    assert args.speculative_deepstack_capture is None


def test_server_argument_refuses_unknown_value(sglang_tp1):
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'deepstack'"):
        _parser().parse_args(["--model-path", "m", "--speculative-deepstack-capture", "deepstack"])


@pytest.mark.parametrize("server, draft, want", [
    (None, None, None),
    (None, {}, None),
    (None, {"final_layer_capture": "post_norm"}, None),
    (None, {"deepstack_capture": "pre_deepstack"}, "pre_deepstack"),
    (None, {"deepstack_capture": "post_deepstack"}, "post_deepstack"),
    ("pre_deepstack", {"deepstack_capture": "post_deepstack"}, "pre_deepstack"),
    ("post_deepstack", None, "post_deepstack"),
])
def test_resolution_server_over_draft_over_model_default(sglang_tp1, server, draft, want):
    from sglang.srt.layers.aux_hidden_states import resolve_deepstack_capture

    assert resolve_deepstack_capture(server, draft, "eagle_config") == want


def test_unknown_value_is_one_error_naming_its_source(sglang_tp1):
    from sglang.srt.layers.aux_hidden_states import resolve_deepstack_capture

    with pytest.raises(ValueError) as exc:
        resolve_deepstack_capture(None, {"deepstack_capture": "post"}, "dflash_config")
    message = str(exc.value)
    assert "\n" not in message
    assert "dflash_config.deepstack_capture='post'" in message and "post_deepstack" in message
    with pytest.raises(ValueError, match="--speculative-deepstack-capture='x'"):
        resolve_deepstack_capture("x", None, "eagle_config")


@pytest.mark.parametrize("cls", ["qwen3_vl:Qwen3LLMModel", "qwen3_vl_moe:Qwen3MoeLLMModel"])
def test_model_setter_refuses_unknown_value_and_keeps_its_own(sglang_tp1, cls):
    import importlib

    module, name = cls.split(":")
    setter = getattr(importlib.import_module(f"sglang.srt.models.{module}"), name).set_deepstack_capture
    holder = SimpleNamespace()
    setter(holder, "post_deepstack")
    with pytest.raises(ValueError, match="deepstack_capture='POST'"):
        setter(holder, "POST")
    assert holder.deepstack_capture_post is True
    setter(holder, "pre_deepstack")
    assert holder.deepstack_capture_post is False


class _Wrapper:
    """What the start-up function sees of a model: a module tree whose wrapper holds
    the setters the model runner calls."""

    @staticmethod
    def make(language_model):
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = language_model
                self.requested = None

            def set_eagle3_layers_to_capture(self, layer_ids=None):
                self.requested = layer_ids

        return Wrapper()


def _configure(model, deepstack_capture):
    """The base's start-up function, as the model runner calls it for an EAGLE3 draft."""
    import importlib.util

    state = dict(eagle_use_aux_hidden_state=True, eagle_aux_hidden_state_layer_ids=[0, 1],
                 dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None)
    if importlib.util.find_spec("sglang.srt.model_executor.model_runner_components") is None:
        from sglang.srt.model_executor.model_runner import ModelRunner

        ModelRunner.init_aux_hidden_state_capture(SimpleNamespace(
            model=model, server_args=SimpleNamespace(enable_two_batch_overlap=False),
            model_config=SimpleNamespace(num_hidden_layers=4),
            final_layer_capture="pre_norm", deepstack_capture=deepstack_capture, **state))
        return
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )

    configure_aux_hidden_state_capture(model=model, is_dspark=False,
                                       deepstack_capture=deepstack_capture, **state)


def test_start_up_hands_the_setting_to_the_deepstack_model_through_its_wrapper(sglang_tp1):
    import torch
    from sglang.srt.models.qwen3_vl import Qwen3LLMModel

    class LanguageModel(torch.nn.Module):
        set_deepstack_capture = Qwen3LLMModel.set_deepstack_capture

    for value, post in (("post_deepstack", True), ("pre_deepstack", False)):
        wrapper = _Wrapper.make(LanguageModel())
        _configure(wrapper, value)
        assert wrapper.model.deepstack_capture_post is post
        assert wrapper.requested == [0, 1]


def test_start_up_warns_once_where_no_model_takes_it(sglang_tp1, caplog):
    import torch

    wrapper = _Wrapper.make(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING):
        _configure(wrapper, "pre_deepstack")
    ignored = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert ignored == ["deepstack_capture='pre_deepstack' is ignored: Wrapper adds no "
                       "deepstack embeddings, so its aux hidden state captures have none "
                       "to include or leave out."]
    assert wrapper.requested == [0, 1]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _configure(wrapper, None)
    assert not [r for r in caplog.records if "is ignored" in r.getMessage()]
