# upstream-path: test/registered/unit/models/test_final_layer_capture_ignored.py
"""One warning wherever final_layer_capture='post_norm' is asked for and
cannot apply.

post_norm changes only a capture of the target's last layer. Without aux
hidden states, with draft ids that leave the last layer out (the EAGLE3
default [2, L // 2, L - 3] among them) or on a model that keeps no
layers_to_capture of its own, configure_aux_hidden_state_capture says once
that it is ignored, instead of dropping it without a word.

Runs on CPU without a GPU or a checkpoint: LlamaForCausalLM's real setters
over a language model that only holds the ids.
"""

import types
import unittest
from unittest import mock

from torch import nn

from sglang.srt.model_executor.model_runner_components import attention_backend_setup
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

NUM_LAYERS = 8


class _LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers_to_capture = []


def _llama():
    lm = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(lm)
    lm.model = _LanguageModel()
    lm.config = types.SimpleNamespace(hidden_size=8, num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


class _External(nn.Module):
    """A model whose captures another package takes (as MindSporeForCausalLM's)."""

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.requested = layer_ids


class TestFinalLayerCaptureIgnored(CustomTestCase):
    def _warnings(self, model, eagle3=None, dflash=None):
        with (
            mock.patch.object(
                attention_backend_setup,
                "get_exec",
                lambda: types.SimpleNamespace(
                    overlap=types.SimpleNamespace(enable_two_batch_overlap=False)
                ),
            ),
            mock.patch.object(attention_backend_setup.logger, "warning") as warning,
        ):
            attention_backend_setup.configure_aux_hidden_state_capture(
                model=model,
                eagle_use_aux_hidden_state=eagle3 is not None,
                eagle_aux_hidden_state_layer_ids=None
                if eagle3 == "default"
                else eagle3,
                dflash_use_aux_hidden_state=dflash is not None,
                dflash_target_layer_ids=dflash,
                is_dspark=False,
                final_layer_capture="post_norm",
                num_layers=NUM_LAYERS,
            )
        return [
            call.args[0]
            for call in warning.call_args_list
            if "final_layer_capture='post_norm' is ignored" in call.args[0]
        ]

    def test_without_a_last_layer_capture_it_warns_once(self):
        for eagle3, dflash, why in (
            (None, None, "takes no aux hidden states"),
            ("default", None, "the default [2, L // 2, L - 3] do not include"),
            ([0, 1, 2], None, "[0, 1, 2] do not include the target's last layer (7)"),
            (None, [0, 2], "[0, 2] do not include the target's last layer (7)"),
        ):
            with self.subTest(eagle3=eagle3, dflash=dflash):
                warned = self._warnings(_llama(), eagle3=eagle3, dflash=dflash)
                self.assertEqual(len(warned), 1, warned)
                self.assertIn(why, warned[0])

    def test_a_model_without_layers_to_capture_warns(self):
        model = _External()
        warned = self._warnings(model, eagle3=[0, 1, NUM_LAYERS - 1])
        self.assertEqual(model.requested, [0, 1, NUM_LAYERS - 1])
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("_External keeps no layers_to_capture", warned[0])

    def test_no_warning_with_the_last_layer(self):
        self.assertEqual(self._warnings(_llama(), eagle3=[0, 1, NUM_LAYERS - 1]), [])
        self.assertEqual(self._warnings(_llama(), dflash=[1, NUM_LAYERS - 1]), [])


if __name__ == "__main__":
    unittest.main()
