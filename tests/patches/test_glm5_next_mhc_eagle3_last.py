"""GLM-5-Next with hyper-connections refuses an EAGLE3 capture of its last layer
(0.5.23's glm5-next-mhc-eagle3-last-refused; issue 28, bug 2).

Under mHC the residual is ``hc_mult`` streams: EAGLE3's in-loop captures are
``[tokens, hc_mult * hidden]`` (only DFlash contracts them, ``_prepare_aux_hidden_state``),
while the last layer contracts its streams into the ``[tokens, hidden]`` it hands on,
so its capture (the final norm's, index ``num_hidden_layers``) has another width: the
packer's copy failed or broadcast. Checked at the entry point the model runner calls,
SGLang's ``Glm5NextForConditionalGeneration.set_eagle3_layers_to_capture``; DFlash, ids
without the last layer, and models without mHC still configure as before.
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("glm5-next-mhc-eagle3-last-refused")
LAYERS = 8
HC_MULT = 4


def _wrapper(mhc: bool):
    from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration, Glm5NextModel

    from harness.suites.models import bare

    return bare(Glm5NextForConditionalGeneration,
                model=bare(Glm5NextModel, layers_to_capture=[], dflash_capture=False),
                pp_group=types.SimpleNamespace(is_last_rank=True, is_first_rank=True),
                config=types.SimpleNamespace(num_hidden_layers=LAYERS, mhc=mhc, hc_mult=HC_MULT),
                capture_aux_hidden_states=False)


@GUARD
@pytest.mark.parametrize("ids", [[1, 4, LAYERS - 1], [LAYERS - 1]])
def test_eagle3_last_layer_with_mhc_refused(ids):
    wrapper = _wrapper(mhc=True)
    with pytest.raises(ValueError, match=rf"layer id {LAYERS - 1} \(the last layer\).*mhc"):
        wrapper.set_eagle3_layers_to_capture(ids)
    assert wrapper.model.layers_to_capture == [] and not wrapper.capture_aux_hidden_states


@pytest.mark.parametrize("mhc, setter, ids, indices", [
    (True, "set_eagle3_layers_to_capture", [1, 4, 6], [2, 5, 7]),
    (True, "set_eagle3_layers_to_capture", None, [2, LAYERS // 2, LAYERS - 3]),
    (True, "set_dflash_layers_to_capture", [1, LAYERS - 1], [2, LAYERS]),
    (False, "set_eagle3_layers_to_capture", [1, LAYERS - 1], [2, LAYERS]),
], ids=["mhc-eagle3-in-loop", "mhc-eagle3-default", "mhc-dflash-last", "eagle3-last"])
def test_other_requests_configure(mhc, setter, ids, indices):
    wrapper = _wrapper(mhc)
    getattr(wrapper, setter)(ids)
    assert wrapper.model.layers_to_capture == indices and wrapper.capture_aux_hidden_states
