# upstream-path: test/registered/unit/models/test_qwen3_vl_deepstack_capture.py
"""Which side of Qwen3-VL's deepstack addition its aux hidden state captures take.

Qwen3-VL adds deepstack embeddings to the output of decoder layers 0-2, so a
capture of index k <= 3 is taken next to that addition. The inference path
adds them to the layer output and captures the stream entering the next layer
(deepstack included); the HF-order path (use_hf_deepstack_order, under
--rl-on-policy-target) passes them as post_residual_addition and its boundary
captures before the read adds them. Unset, each order keeps its own side
(the inference path "post_deepstack", the HF-order path "pre_deepstack");
``deepstack_capture`` makes both orders capture the side it names, and comes
from --speculative-deepstack-capture or the draft config. A "pre_deepstack"
capture on the inference path is taken before the addition, so it is the
layer's output bit for bit, not the sum with the deepstack subtracted again.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the final
norm are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward is the real one.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components import attention_backend_setup
from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration
from sglang.srt.models.qwen3_vl_moe import (
    Qwen3MoeLLMModel,
    Qwen3VLMoeForConditionalGeneration,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
NUM_DEEPSTACK = 3
CAPTURED = [1, 2, 3, NUM_LAYERS]

# Each language model with the wrapper that runs it.
FAMILY = (
    (Qwen3LLMModel, Qwen3VLForConditionalGeneration),
    (Qwen3MoeLLMModel, Qwen3VLMoeForConditionalGeneration),
)


class _Layer(nn.Module):
    """Completes the previous layer's output and captures it when asked, before a
    ``post_residual_addition`` joins the stream (as the attention boundary
    captures before its read), then adds ``layer_id + 1`` for the next boundary."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self,
        positions,
        hidden_states,
        forward_batch,
        post_residual_addition=None,
        capture_output=None,
        **unused,
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        if post_residual_addition is not None:
            hidden_states = residual_batch.set_written(
                hidden_states + post_residual_addition, forward_batch
            )
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        return residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)


class _InPlaceNorm(nn.Module):
    """Fused add + RMSNorm: updates its inputs in place, like the GPU kernel."""

    def forward(self, hidden_states, residual=None, **unused_kwargs):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(model_cls, hf_order):
    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(CAPTURED)
    model.norm = _InPlaceNorm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    model.hidden_size = HIDDEN
    model.deepstack_embed_to_decoder_layer = range(NUM_DEEPSTACK)
    model.use_hf_deepstack_order = hf_order
    return model


def _captures(model, embeds, deepstack):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=None,
    )
    _, aux = model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
        input_deepstack_embeds=deepstack,
    )
    return aux


def _expected(embeds, deepstack, post):
    # Capture index i: the output of layer i - 1 (embeds + 1 + ... + i) with the
    # deepstack of layers 0 .. i - 2 in it; "post_deepstack" adds layer i - 1's.
    captures = []
    for i in CAPTURED:
        with_deepstack = min(i if post or i == NUM_LAYERS else i - 1, NUM_DEEPSTACK)
        capture = embeds + float(sum(range(1, i + 1)))
        for j in range(with_deepstack):
            capture = capture + deepstack[:, j * HIDDEN : (j + 1) * HIDDEN]
        captures.append(capture)
    return torch.cat(captures, dim=-1)


def _wrapper(wrapper_cls, language_model):
    wrapper = wrapper_cls.__new__(wrapper_cls)
    nn.Module.__init__(wrapper)
    wrapper.model = language_model
    wrapper.config = types.SimpleNamespace(
        hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
    )
    wrapper.pp_group = types.SimpleNamespace(is_last_rank=True)
    wrapper.capture_aux_hidden_states = False
    return wrapper


def _configure(model, deepstack_capture):
    with mock.patch.object(
        attention_backend_setup,
        "get_exec",
        lambda: types.SimpleNamespace(
            overlap=types.SimpleNamespace(enable_two_batch_overlap=False)
        ),
    ):
        attention_backend_setup.configure_aux_hidden_state_capture(
            model=model,
            eagle_use_aux_hidden_state=True,
            eagle_aux_hidden_state_layer_ids=[i - 1 for i in CAPTURED],
            dflash_use_aux_hidden_state=False,
            dflash_target_layer_ids=None,
            is_dspark=False,
            deepstack_capture=deepstack_capture,
        )


class TestQwen3VLDeepstackCapture(CustomTestCase):
    def _check(self, setting, post, orders=(False, True)):
        for model_cls, wrapper_cls in FAMILY:
            for hf_order in orders:
                with self.subTest(
                    model=model_cls.__name__, hf_order=hf_order, setting=setting
                ):
                    torch.manual_seed(0)
                    embeds = torch.randn(TOKENS, HIDDEN)
                    deepstack = torch.randn(TOKENS, NUM_DEEPSTACK * HIDDEN)
                    model = _model(model_cls, hf_order)
                    _configure(_wrapper(wrapper_cls, model), setting)
                    self.assertEqual(model.layers_to_capture, CAPTURED)
                    torch.testing.assert_close(
                        _captures(model, embeds.clone(), deepstack),
                        _expected(embeds, deepstack, post),
                    )

    def test_unset_keeps_each_order_its_own_side(self):
        for hf_order in (False, True):
            self._check(None, post=not hf_order, orders=(hf_order,))

    def test_post_deepstack_on_both_orders(self):
        self._check("post_deepstack", post=True)

    def test_pre_deepstack_takes_the_previous_layer_output_on_both_orders(self):
        self._check("pre_deepstack", post=False)

    def test_pre_deepstack_is_the_layer_output_bit_for_bit(self):
        # Layer j's output does not depend on its own deepstack: the capture after it
        # must equal, bit for bit, that of a forward whose deepstack j alone is zero.
        # Large deepstack values make (x + d) - d differ from x in the last bits.
        for dtype in (torch.bfloat16, torch.float32):
            for model_cls, wrapper_cls in FAMILY:
                for hf_order in (False, True):
                    with self.subTest(
                        model=model_cls.__name__, hf_order=hf_order, dtype=dtype
                    ):
                        torch.manual_seed(1)
                        embeds = torch.randn(TOKENS, HIDDEN).to(dtype)
                        deepstack = (
                            torch.randn(TOKENS, NUM_DEEPSTACK * HIDDEN) * 300
                        ).to(dtype)
                        model = _model(model_cls, hf_order)
                        _configure(_wrapper(wrapper_cls, model), "pre_deepstack")
                        got = _captures(model, embeds.clone(), deepstack)
                        for j in range(NUM_DEEPSTACK):
                            zeroed = deepstack.clone()
                            zeroed[:, j * HIDDEN : (j + 1) * HIDDEN] = 0
                            alone = _captures(model, embeds.clone(), zeroed)
                            k = CAPTURED.index(j + 1)
                            cols = slice(k * HIDDEN, (k + 1) * HIDDEN)
                            self.assertTrue(
                                torch.equal(got[:, cols], alone[:, cols]), (j, dtype)
                            )

    def test_text_only_batches_are_unchanged(self):
        for model_cls, _ in FAMILY:
            for hf_order in (False, True):
                with self.subTest(model=model_cls.__name__, hf_order=hf_order):
                    embeds = torch.randn(TOKENS, HIDDEN)
                    model = _model(model_cls, hf_order)
                    model.set_deepstack_capture("pre_deepstack")
                    torch.testing.assert_close(
                        _captures(model, embeds.clone(), None),
                        _expected(
                            embeds, torch.zeros(TOKENS, NUM_DEEPSTACK * HIDDEN), True
                        ),
                    )


class TestDeepstackCaptureSetting(CustomTestCase):
    def test_server_value_over_draft_config_over_model_default(self):
        draft = {"deepstack_capture": "pre_deepstack"}
        self.assertIsNone(
            aux_hidden_states.resolve_deepstack_capture(None, None, "eagle_config")
        )
        self.assertIsNone(
            aux_hidden_states.resolve_deepstack_capture(None, {}, "eagle_config")
        )
        self.assertEqual(
            aux_hidden_states.resolve_deepstack_capture(None, draft, "eagle_config"),
            "pre_deepstack",
        )
        self.assertEqual(
            aux_hidden_states.resolve_deepstack_capture(
                "post_deepstack", draft, "eagle_config"
            ),
            "post_deepstack",
        )

    def test_unknown_values_raise_naming_their_source(self):
        with self.assertRaisesRegex(ValueError, "dflash_config.deepstack_capture"):
            aux_hidden_states.resolve_deepstack_capture(
                None, {"deepstack_capture": "after"}, "dflash_config"
            )
        with self.assertRaisesRegex(ValueError, "--speculative-deepstack-capture"):
            aux_hidden_states.resolve_deepstack_capture("pre", None, "eagle_config")
        model = _model(Qwen3LLMModel, False)
        with self.assertRaisesRegex(ValueError, "deepstack_capture"):
            model.set_deepstack_capture("PRE_DEEPSTACK")
        self.assertIsNone(model.deepstack_capture_post)

    def test_a_model_without_deepstack_logs_that_it_is_ignored(self):
        model = nn.Linear(2, 2)
        model.set_eagle3_layers_to_capture = lambda layer_ids=None: None
        with self.assertLogs(attention_backend_setup.logger, "WARNING") as logs:
            _configure(model, "pre_deepstack")
        self.assertIn("deepstack_capture='pre_deepstack' is ignored", logs.output[0])


if __name__ == "__main__":
    unittest.main()
