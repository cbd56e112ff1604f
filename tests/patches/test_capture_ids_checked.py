"""Aux capture layer ids that name a layer twice, or a layer the target lacks, are one
error at start-up (the pin's capture-ids-checked, 0.5.23's capture-ids-checked).

A forward captures each layer once and never reaches a layer past its last, so such
ids gave K-1 states where the draft's fc expects K (at the pin: a shape error in the
draft at the first forward; on 0.5.23: "captured K-1 of K" while the decode graphs are
captured). Checked through the function the model runner calls at start-up
(``harness.parity.runner.request_captures``: the pin's
``ModelRunner.init_aux_hidden_state_capture``, 0.5.23's
``configure_aux_hidden_state_capture`` after ``resolve_spec_aux_hidden_state_config``'s
range check), on SGLang's real ``LlamaForCausalLM`` setters over a tiny real
``LlamaModel`` of 4 layers (the ``tiny_llama_lm`` fixture).
"""

from __future__ import annotations

import importlib.util
import types

import pytest

from harness.parity.runner import request_captures

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

# tiny_llama_lm's layers (tests/patches/conftest.py): so shallow that EAGLE3's default
# ids [2, L // 2, L - 3] repeat one ([2, 2, 1]).
NUM_LAYERS = 4


def _start_up(model, eagle3=None, dflash=None):
    """The base's start-up for an EAGLE3 (``eagle3``: the draft's ids, ``"default"``
    for none) or DFlash draft, as the model runner runs it."""
    if eagle3 not in (None, "default") and importlib.util.find_spec(
            "sglang.srt.model_executor.model_runner_components") is not None:
        from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state

        # Where 0.5.23 reads the draft's EAGLE3 ids (_resolve_eagle_aux_hidden_state).
        spec_aux_hidden_state._check_capture_layer_ids_in_range(
            list(eagle3), types.SimpleNamespace(hf_text_config=types.SimpleNamespace(
                num_hidden_layers=NUM_LAYERS)),
            "eagle_config.eagle_aux_hidden_state_layer_ids")
    request_captures(model, eagle3=eagle3, dflash=dflash)


@pytest.mark.parametrize("eagle3, dflash, want", [
    ([0, 1, 3], None, [1, 2, 4]),
    (None, [0, 2, 3], [1, 3, 4]),
    ([1, 2], None, [2, 3]),
], ids=["eagle3", "dflash", "eagle3-two"])
def test_distinct_ids_in_range_pass_unchanged(tiny_llama_lm, eagle3, dflash, want):
    """What the checks let through (no regression test: true without them too)."""
    _start_up(tiny_llama_lm, eagle3=eagle3, dflash=dflash)
    assert tiny_llama_lm.model.layers_to_capture == want


@pytest.mark.guards("capture-ids-checked")
@pytest.mark.parametrize("eagle3, dflash, match", [
    ([0, 1, 1], None, r"capture layer\(s\) \[2\] twice \(layers_to_capture \[1, 2, 2\]\)"),
    (None, [1, 3, 3], r"capture layer\(s\) \[4\] twice \(layers_to_capture \[2, 4, 4\]\)"),
    # EAGLE3's default [2, L // 2, L - 3] on 4 layers: [2, 2, 1].
    ("default", None, r"capture layer\(s\) \[2\] twice \(layers_to_capture \[2, 2, 1\]\)"),
    ([0, 2, 4], None, r"eagle_config.eagle_aux_hidden_state_layer_ids \[4\] out of range "
                      r"for a target with 4 layers"),
], ids=["eagle3-repeat", "dflash-repeat", "eagle3-default-shallow", "eagle3-out-of-range"])
def test_repeated_or_missing_layer_is_one_error(tiny_llama_lm, eagle3, dflash, match):
    with pytest.raises(ValueError, match=match) as exc:
        _start_up(tiny_llama_lm, eagle3=eagle3, dflash=dflash)
    assert "\n" not in str(exc.value)


@pytest.mark.guards("capture-ids-checked")
@pytest.mark.bases("0.5.23")
def test_dspark_ids_kept_outside_layers_to_capture_are_checked(tiny_kimi_linear_lm):
    """kimi_linear keeps a DSpark draft's ids in ``dspark_layers_to_capture`` (as kimi_k3
    and deepseek_v4 do): a repeat there is the same one error."""
    with pytest.raises(ValueError, match=r"capture layer\(s\) \[2\] twice "
                                         r"\(dspark_layers_to_capture \[1, 2, 2\]\)") as exc:
        request_captures(tiny_kimi_linear_lm, dflash=[1, 2, 2], dspark=True)
    assert "\n" not in str(exc.value)
