"""Qwen4-Exp refuses aux capture ids instead of serving no features (0.5.23's
qwen4-exp-refuses-captures; issue 28, bug 5).

Its decoder layers take ``captured_last_layer_outputs`` and write nothing into it, so
the ids its inherited setters (Qwen3-VL's wrapper over Qwen3.5's model) accepted gave
an EAGLE3, DFlash or DSpark draft, or ``--enable-return-aux-hidden-states``, no
features and no error. Checked at the entry points the model runner calls: the
wrapper's setters on SGLang's ``Qwen4ExpForConditionalGeneration`` over its
``Qwen4ExpVLModel``.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("qwen4-exp-refuses-captures")


def _wrapper():
    from sglang.srt.models.qwen4_exp import Qwen4ExpForConditionalGeneration, Qwen4ExpVLModel

    from harness.suites.models import bare

    return bare(Qwen4ExpForConditionalGeneration,
                model=bare(Qwen4ExpVLModel, layers_to_capture=[]),
                pp_group=types.SimpleNamespace(is_last_rank=True, is_first_rank=True),
                config=types.SimpleNamespace(num_hidden_layers=8),
                capture_aux_hidden_states=False)


@GUARD
@pytest.mark.parametrize("setter,ids", [
    ("set_eagle3_layers_to_capture", [1, 3, 6]),
    ("set_eagle3_layers_to_capture", None),
    ("set_dflash_layers_to_capture", [0, 4]),
])
def test_capture_ids_refused(setter, ids):
    wrapper = _wrapper()
    with pytest.raises(ValueError, match="Qwen4-Exp captures no aux hidden states"):
        getattr(wrapper, setter)(ids)
    assert wrapper.model.layers_to_capture == []
