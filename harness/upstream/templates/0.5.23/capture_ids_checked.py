# upstream-path: test/registered/unit/models/test_aux_capture_layer_ids.py
"""Aux hidden state layer ids that repeat a layer, or name one the target lacks,
are one error at start-up.

A forward captures each layer once and never reaches a layer past its last, so
such ids gave the draft K-1 captures where it expects K ("captured K-1 of K"
at the first forward). configure_aux_hidden_state_capture refuses a repeat
once the setters have set the ids (the draft's, or a setter's EAGLE3 default
[2, L // 2, L - 3], which repeats a layer below 7 layers), in
layers_to_capture or in the dspark_layers_to_capture in which kimi_k3,
kimi_linear and deepseek_v4 keep a DSpark draft's, and the draft config's
EAGLE3 ids are range-checked where they are read.

Runs on CPU without a GPU or a checkpoint: LlamaForCausalLM's and
KimiLinearForCausalLM's real setters over a language model that only holds
the ids.
"""

import types
import unittest
from unittest import mock

from torch import nn

from sglang.srt.model_executor.model_runner_components import (
    attention_backend_setup,
    spec_aux_hidden_state,
)
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

NUM_LAYERS = 4


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


def _configure(model, eagle3=None, dflash=None, dspark=False):
    with mock.patch.object(
        attention_backend_setup,
        "get_exec",
        lambda: types.SimpleNamespace(
            overlap=types.SimpleNamespace(enable_two_batch_overlap=False)
        ),
    ):
        attention_backend_setup.configure_aux_hidden_state_capture(
            model=model,
            eagle_use_aux_hidden_state=eagle3 is not None,
            eagle_aux_hidden_state_layer_ids=None if eagle3 == "default" else eagle3,
            dflash_use_aux_hidden_state=dflash is not None,
            dflash_target_layer_ids=dflash,
            is_dspark=dspark,
        )


class TestAuxCaptureLayerIds(CustomTestCase):
    def test_distinct_ids_pass_unchanged(self):
        for eagle3, dflash, want in (
            ([0, 1, 3], None, [1, 2, 4]),
            (None, [0, 2, 3], [1, 3, 4]),
        ):
            with self.subTest(eagle3=eagle3, dflash=dflash):
                model = _llama()
                _configure(model, eagle3=eagle3, dflash=dflash)
                self.assertEqual(model.model.layers_to_capture, want)

    def test_a_repeated_layer_is_one_error(self):
        for eagle3, dflash, repeated in (
            ([0, 1, 1], None, r"\[2\] twice"),
            (None, [1, 3, 3], r"\[4\] twice"),
            # The EAGLE3 default on 4 layers: [2, 2, 1].
            ("default", None, r"\[2\] twice \(layers_to_capture \[2, 2, 1\]\)"),
        ):
            with self.subTest(eagle3=eagle3, dflash=dflash):
                with self.assertRaisesRegex(ValueError, repeated) as ctx:
                    _configure(_llama(), eagle3=eagle3, dflash=dflash)
                self.assertNotIn("\n", str(ctx.exception))

    def test_a_repeated_dspark_layer_is_one_error(self):
        with self.assertRaisesRegex(
            ValueError, r"\[2\] twice \(dspark_layers_to_capture \[1, 2, 2\]\)"
        ):
            _configure(_kimi_linear(), dflash=[1, 2, 2], dspark=True)

    def test_draft_ids_past_the_last_layer_are_refused(self):
        model_config = types.SimpleNamespace(
            hf_text_config=types.SimpleNamespace(num_hidden_layers=NUM_LAYERS)
        )
        source = "eagle_config.eagle_aux_hidden_state_layer_ids"
        spec_aux_hidden_state._check_capture_layer_ids_in_range(
            [0, 1, 3], model_config, source
        )
        with self.assertRaisesRegex(
            ValueError, rf"{source} \[4\] out of range for a target with 4 layers"
        ):
            spec_aux_hidden_state._check_capture_layer_ids_in_range(
                [0, 2, 4], model_config, source
            )


if __name__ == "__main__":
    unittest.main()
