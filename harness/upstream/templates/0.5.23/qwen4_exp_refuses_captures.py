# upstream-path: test/registered/unit/models/test_qwen4_exp_aux_capture.py
"""Qwen4-Exp refuses aux hidden state capture ids.

Its decoder layers take captured_last_layer_outputs and write nothing into
it. The setters it inherits (Qwen3-VL's wrapper over Qwen3.5's model)
accepted ids, so an EAGLE3, DFlash or DSpark draft got no features and no
error. The model runner calls these setters at start-up; they now refuse.

Runs on CPU without a GPU or a checkpoint: the real wrapper and model
classes, built without weights.
"""

import types
import unittest

from torch import nn

from sglang.srt.models.qwen4_exp import (
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpVLModel,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


def _wrapper():
    wrapper = Qwen4ExpForConditionalGeneration.__new__(Qwen4ExpForConditionalGeneration)
    nn.Module.__init__(wrapper)
    model = Qwen4ExpVLModel.__new__(Qwen4ExpVLModel)
    nn.Module.__init__(model)
    model.layers_to_capture = []
    wrapper.model = model
    wrapper.pp_group = types.SimpleNamespace(is_last_rank=True, is_first_rank=True)
    wrapper.config = types.SimpleNamespace(num_hidden_layers=8)
    wrapper.capture_aux_hidden_states = False
    return wrapper


class TestQwen4ExpAuxCapture(CustomTestCase):
    def test_capture_ids_are_refused(self):
        for setter, ids in (
            ("set_eagle3_layers_to_capture", [1, 3, 6]),
            ("set_eagle3_layers_to_capture", None),
            ("set_dflash_layers_to_capture", [0, 4]),
        ):
            with self.subTest(setter=setter, ids=ids):
                wrapper = _wrapper()
                with self.assertRaisesRegex(
                    ValueError, "Qwen4-Exp captures no aux hidden states"
                ):
                    getattr(wrapper, setter)(ids)
                self.assertEqual(wrapper.model.layers_to_capture, [])


if __name__ == "__main__":
    unittest.main()
