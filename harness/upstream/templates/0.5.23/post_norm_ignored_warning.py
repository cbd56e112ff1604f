# upstream-path: test/registered/unit/models/test_final_layer_capture_ignored.py
"""One warning wherever final_layer_capture='post_norm' is asked for and
cannot apply.

post_norm changes only a capture of the target's last layer. Without aux
hidden states, with draft ids that leave the last layer out (the EAGLE3
default [2, L // 2, L - 3] among them) or on a model that keeps no capture
ids of its own, configure_aux_hidden_state_capture says once that it is
ignored, instead of dropping it without a word. A model's ids are its
layers_to_capture, or the dspark_layers_to_capture in which kimi_k3,
kimi_linear and deepseek_v4 keep a DSpark draft's.

Runs on CPU without a GPU or a checkpoint: LlamaForCausalLM's and
KimiLinearForCausalLM's real setters over a language model that only holds
the ids.
"""

import types
import unittest
from unittest import mock

from torch import nn

from sglang.srt.model_executor.model_runner_components import attention_backend_setup
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

NUM_LAYERS = 8


class _LanguageModel(nn.Module):
    def __init__(self, attr):
        super().__init__()
        setattr(self, attr, [] if attr == "layers_to_capture" else None)


def _causal_lm(cls, attr):
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = _LanguageModel(attr)
    lm.config = types.SimpleNamespace(hidden_size=8, num_hidden_layers=NUM_LAYERS)
    lm.pp_group = types.SimpleNamespace(is_last_rank=True)
    lm.capture_aux_hidden_states = False
    return lm


def _llama():
    return _causal_lm(LlamaForCausalLM, "layers_to_capture")


def _kimi_linear():
    # DSpark only: its model keeps the ids in dspark_layers_to_capture.
    return _causal_lm(KimiLinearForCausalLM, "dspark_layers_to_capture")


class _External(nn.Module):
    """A model whose captures another package takes (as MindSporeForCausalLM's)."""

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.requested = layer_ids


class TestFinalLayerCaptureIgnored(CustomTestCase):
    def _warnings(self, model, eagle3=None, dflash=None, dspark=False):
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
                is_dspark=dspark,
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

    def test_dspark_ids_in_dspark_layers_to_capture(self):
        warned = self._warnings(_kimi_linear(), dflash=[0, 2], dspark=True)
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("[0, 2] do not include the target's last layer (7)", warned[0])
        model = _kimi_linear()
        self.assertEqual(
            self._warnings(model, dflash=[1, NUM_LAYERS - 1], dspark=True), []
        )
        self.assertEqual(model.model.dspark_layers_to_capture, [1, NUM_LAYERS - 1])


if __name__ == "__main__":
    unittest.main()
