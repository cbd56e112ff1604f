"""Aux capture layer ids that name a layer twice, or a layer the target lacks, are one
error at start-up (the pin's capture-ids-checked, 0.5.23's capture-ids-checked).

A forward captures each layer once and never reaches a layer past its last, so such
ids gave K-1 states where the draft's fc expects K (at the pin: a shape error in the
draft at the first forward; on 0.5.23: "captured K-1 of K" while the decode graphs are
captured). Checked through the function the model runner calls at start-up (the pin's
``ModelRunner.init_aux_hidden_state_capture``, 0.5.23's
``configure_aux_hidden_state_capture`` after ``resolve_spec_aux_hidden_state_config``'s
range check), on SGLang's real ``LlamaForCausalLM`` setters over a tiny real
``LlamaModel`` of 4 layers (``harness.standins``).
"""

from __future__ import annotations

import importlib.util
import types

import pytest

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def llama(sglang_tp1):
    """A real LlamaForCausalLM (the setters the model runner calls) over a tiny real
    LlamaModel of ``NUM_LAYERS`` layers."""
    import dataclasses

    from sglang.srt.models.llama import LlamaForCausalLM
    from torch import nn

    from harness.standins.models import build, specs

    spec = specs()["llama"]
    tiny = dataclasses.replace(spec.tiny, num_layers=NUM_LAYERS, dtype="float32")
    lm = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(lm)
    lm.model = build(dataclasses.replace(spec, tiny=tiny), tiny)
    lm.config = types.SimpleNamespace(hidden_size=tiny.hidden_size,
                                      num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


def _start_up(model, eagle3=None, dflash=None):
    """The base's start-up for an EAGLE3 (``eagle3``: the draft's ids, ``"default"``
    for none) or DFlash draft, as the model runner runs it."""
    eagle_ids = None if eagle3 in (None, "default") else list(eagle3)
    state = dict(eagle_use_aux_hidden_state=eagle3 is not None,
                 eagle_aux_hidden_state_layer_ids=eagle_ids,
                 dflash_use_aux_hidden_state=dflash is not None,
                 dflash_target_layer_ids=None if dflash is None else list(dflash))
    if importlib.util.find_spec("sglang.srt.model_executor.model_runner_components") is None:
        from sglang.srt.model_executor.model_runner import ModelRunner

        ModelRunner.init_aux_hidden_state_capture(types.SimpleNamespace(
            model=model, server_args=types.SimpleNamespace(enable_two_batch_overlap=False),
            model_config=types.SimpleNamespace(num_hidden_layers=NUM_LAYERS),
            final_layer_capture="pre_norm", deepstack_capture=None, **state))
        return
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )

    if eagle_ids is not None:
        # Where 0.5.23 reads the draft's EAGLE3 ids (_resolve_eagle_aux_hidden_state).
        spec_aux_hidden_state._check_capture_layer_ids_in_range(
            eagle_ids, types.SimpleNamespace(hf_text_config=types.SimpleNamespace(
                num_hidden_layers=NUM_LAYERS)),
            "eagle_config.eagle_aux_hidden_state_layer_ids")
    configure_aux_hidden_state_capture(model=model, is_dspark=False, **state)


@pytest.mark.parametrize("eagle3, dflash, want", [
    ([0, 1, 3], None, [1, 2, 4]),
    (None, [0, 2, 3], [1, 3, 4]),
    ([1, 2], None, [2, 3]),
], ids=["eagle3", "dflash", "eagle3-two"])
def test_distinct_ids_in_range_pass_unchanged(llama, eagle3, dflash, want):
    """What the checks let through (no regression test: true without them too)."""
    _start_up(llama, eagle3=eagle3, dflash=dflash)
    assert llama.model.layers_to_capture == want


@pytest.mark.guards("capture-ids-checked")
@pytest.mark.parametrize("eagle3, dflash, match", [
    ([0, 1, 1], None, r"capture layer\(s\) \[2\] twice \(layers_to_capture \[1, 2, 2\]\)"),
    (None, [1, 3, 3], r"capture layer\(s\) \[4\] twice \(layers_to_capture \[2, 4, 4\]\)"),
    # EAGLE3's default [2, L // 2, L - 3] on 4 layers: [2, 2, 1].
    ("default", None, r"capture layer\(s\) \[2\] twice \(layers_to_capture \[2, 2, 1\]\)"),
    ([0, 2, 4], None, r"eagle_config.eagle_aux_hidden_state_layer_ids \[4\] out of range "
                      r"for a target with 4 layers"),
], ids=["eagle3-repeat", "dflash-repeat", "eagle3-default-shallow", "eagle3-out-of-range"])
def test_repeated_or_missing_layer_is_one_error(llama, eagle3, dflash, match):
    with pytest.raises(ValueError, match=match) as exc:
        _start_up(llama, eagle3=eagle3, dflash=dflash)
    assert "\n" not in str(exc.value)
