"""The last layer's capture setting (patch final-layer-capture) at the entry points the
engine calls: the server argument's CLI parser, and the resolution the model runner
does with the draft config. The captures themselves are checked against transformers
(tests/parity), through the model matrix (tests/multirank) and in the real Engine
(tests/e2e)."""

from __future__ import annotations

import argparse

import pytest

pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"),
              pytest.mark.guards("final-layer-capture")]


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("value", ["pre_norm", "post_norm"])
def test_server_argument_parses(sglang_tp1, value):
    args = _parser().parse_args(
        ["--model-path", "m", "--speculative-final-layer-capture", value])
    assert args.speculative_final_layer_capture == value


def test_server_argument_defaults_to_the_draft_config(sglang_tp1):
    args = _parser().parse_args(["--model-path", "m"])
    assert args.speculative_final_layer_capture is None


def test_server_argument_refuses_unknown_value(sglang_tp1):
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'mid_norm'"):
        _parser().parse_args(["--model-path", "m", "--speculative-final-layer-capture", "mid_norm"])


@pytest.mark.parametrize("server, draft, want", [
    (None, None, "pre_norm"),
    (None, {}, "pre_norm"),
    (None, {"eagle_aux_hidden_state_layer_ids": [0, 1]}, "pre_norm"),
    (None, {"final_layer_capture": "post_norm"}, "post_norm"),
    ("pre_norm", {"final_layer_capture": "post_norm"}, "pre_norm"),
    ("post_norm", {"final_layer_capture": "pre_norm"}, "post_norm"),
    ("post_norm", None, "post_norm"),
])
def test_resolution_server_over_draft_over_default(sglang_tp1, server, draft, want):
    from sglang.srt.layers.aux_hidden_states import resolve_final_layer_capture

    assert resolve_final_layer_capture(server, draft, "eagle_config") == want


def test_unknown_draft_value_is_one_error_naming_its_source(sglang_tp1):
    from sglang.srt.layers.aux_hidden_states import (
        final_layer_capture_post_norm,
        resolve_final_layer_capture,
        set_final_layer_capture,
    )

    with pytest.raises(ValueError) as exc:
        resolve_final_layer_capture(None, {"final_layer_capture": "postnorm"}, "dflash_config")
    message = str(exc.value)
    assert "\n" not in message
    assert "dflash_config.final_layer_capture='postnorm'" in message and "post_norm" in message
    with pytest.raises(ValueError, match="--speculative-final-layer-capture='x'"):
        resolve_final_layer_capture("x", None, "eagle_config")
    if _held_by_the_model(set_final_layer_capture):
        # 0.5.23: the modules that keep capture ids hold it; a refused value leaves
        # theirs as it was, and another model keeps its own.
        from torch import nn

        target, other = nn.Module(), nn.Module()
        target.layers_to_capture, other.layers_to_capture = [1], [1]
        set_final_layer_capture(target, "post_norm")
        with pytest.raises(ValueError):
            set_final_layer_capture(target, "PRE_NORM")
        assert final_layer_capture_post_norm(target)
        assert not final_layer_capture_post_norm(other)
        return
    # the pin: a refused value leaves the process's setting as it was
    set_final_layer_capture("post_norm")
    try:
        with pytest.raises(ValueError):
            set_final_layer_capture("PRE_NORM")
        assert final_layer_capture_post_norm()
    finally:
        set_final_layer_capture("pre_norm")
    assert not final_layer_capture_post_norm()


def _held_by_the_model(set_final_layer_capture) -> bool:
    """0.5.23's series holds the setting on the model (``set_final_layer_capture(model,
    value)``); the pin's is process-wide (``set_final_layer_capture(value)``)."""
    import inspect

    return len(inspect.signature(set_final_layer_capture).parameters) == 2


@pytest.mark.bases("0.5.23")
def test_draft_config_given_as_an_object(sglang_tp1):
    """A draft config section that is a config object, not a dict: read, not an
    AttributeError at start-up (issue 28, bug 4)."""
    from types import SimpleNamespace

    from sglang.srt.layers.aux_hidden_states import resolve_final_layer_capture

    assert resolve_final_layer_capture(
        None, SimpleNamespace(final_layer_capture="post_norm"), "eagle_config") == "post_norm"
    assert resolve_final_layer_capture(None, SimpleNamespace(), "eagle_config") == "pre_norm"


@pytest.mark.bases("0.5.23")
@pytest.mark.parametrize("hf_config, want", [
    ({"dspark_config": {"final_layer_capture": "post_norm"}}, "post_norm"),
    ({"dspark_final_layer_capture": "post_norm"}, "post_norm"),
    ({"dflash_config": {"final_layer_capture": "post_norm"},
      "dspark_config": {"final_layer_capture": "pre_norm"}}, "pre_norm"),
    ({"dflash_config": {"final_layer_capture": "post_norm"}}, "post_norm"),
], ids=["dspark_config", "top-level", "dspark-over-dflash", "dflash_config"])
def test_dspark_draft_fields(sglang_tp1, hf_config, want):
    """A DSpark draft keeps its fields in dspark_config or top-level dspark_* keys (over
    dflash_config), where the model runner's resolution now reads the setting
    (issue 28, bug 1: it read dflash_config alone and resolved pre_norm)."""
    from sglang.srt.layers.aux_hidden_states import resolve_final_layer_capture
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state

    settings, source = spec_aux_hidden_state._block_draft_capture_config(hf_config, is_dspark=True)
    assert source == "dspark_config"
    assert resolve_final_layer_capture(None, settings, source) == want
