# upstream-path: test/registered/unit/models/test_glm5_next_mhc_eagle3_capture.py
"""GLM-5-Next with hyper-connections refuses an EAGLE3 capture of its last layer.

Under mhc, EAGLE3's in-loop captures are the hc_mult hyper-connection streams,
[tokens, hc_mult * hidden], while the last layer contracts its streams into
the [tokens, hidden] it hands on: its capture cannot have the others' width.
The setter refuses the last layer's id at start-up; DFlash (which contracts
every capture), other ids and models without mhc configure as before.

Runs on CPU without a GPU or a checkpoint: the real setter on the real
classes, created without their __init__.
"""

import types
import unittest

from torch import nn

from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration, Glm5NextModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

LAYERS = 8


def _wrapper(mhc):
    wrapper = Glm5NextForConditionalGeneration.__new__(Glm5NextForConditionalGeneration)
    nn.Module.__init__(wrapper)
    model = Glm5NextModel.__new__(Glm5NextModel)
    nn.Module.__init__(model)
    model.layers_to_capture = []
    model.dflash_capture = False
    wrapper.model = model
    wrapper.pp_group = types.SimpleNamespace(is_last_rank=True, is_first_rank=True)
    wrapper.config = types.SimpleNamespace(num_hidden_layers=LAYERS, mhc=mhc, hc_mult=4)
    wrapper.capture_aux_hidden_states = False
    return wrapper


class TestGlm5NextMhcEagle3Capture(CustomTestCase):
    def test_last_layer_refused_with_mhc(self):
        for ids in ([1, 4, LAYERS - 1], [LAYERS - 1]):
            with self.subTest(ids=ids):
                wrapper = _wrapper(mhc=True)
                with self.assertRaisesRegex(ValueError, "the last layer.*mhc"):
                    wrapper.set_eagle3_layers_to_capture(ids)
                self.assertEqual(wrapper.model.layers_to_capture, [])
                self.assertFalse(wrapper.capture_aux_hidden_states)

    def test_other_requests_configure(self):
        cases = [
            (True, "set_eagle3_layers_to_capture", [1, 4, 6], [2, 5, 7]),
            (True, "set_eagle3_layers_to_capture", None, [2, LAYERS // 2, LAYERS - 3]),
            (True, "set_dflash_layers_to_capture", [1, LAYERS - 1], [2, LAYERS]),
            (False, "set_eagle3_layers_to_capture", [1, LAYERS - 1], [2, LAYERS]),
        ]
        for mhc, setter, ids, indices in cases:
            with self.subTest(mhc=mhc, setter=setter, ids=ids):
                wrapper = _wrapper(mhc)
                getattr(wrapper, setter)(ids)
                self.assertEqual(wrapper.model.layers_to_capture, indices)
                self.assertTrue(wrapper.capture_aux_hidden_states)


if __name__ == "__main__":
    unittest.main()
