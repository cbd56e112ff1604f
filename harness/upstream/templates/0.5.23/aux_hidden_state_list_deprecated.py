# upstream-path: test/registered/unit/models/test_aux_hidden_state_list_deprecated.py
"""The EAGLE3 drafts hand on their capture without a copy, and the list path is
deprecated.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H); every in-tree capturing model
now packs them into one [T, K * H] buffer (AuxHiddenStatePacker). The EAGLE3
drafts hand their one capture on as it is (K = 1 is packed): the final norm's
output, or the residual it updated in place, without a copy. With no list left
in the tree, AuxHiddenStateList is deprecated: a list an out-of-tree model
returns is still concatenated, with one warning naming the packer, for one
release.

Runs on CPU without a GPU or a checkpoint: the draft's decoder layer and final
norm are small stand-ins (sglang.test.aux_capture_test_utils), the draft's
forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.models.llama_eagle3 import LlamaModel as Eagle3LlamaModel
from sglang.test.aux_capture_test_utils import InPlaceNorm, forward_batch
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5


class _DraftLayer(nn.Module):
    """An EAGLE3 draft decoder layer: adds the embeddings to the stream and hands
    the stream it took as the residual."""

    def forward(self, positions, embeds, hidden_states, forward_batch, residual):
        return hidden_states + embeds, hidden_states.clone()


def _eagle3_draft(norm_output):
    model = Eagle3LlamaModel.__new__(Eagle3LlamaModel)
    nn.Module.__init__(model)
    model.is_mrope_enabled = False
    model.input_norm = model.fc_norm = None
    model.layers = nn.ModuleList([_DraftLayer()])
    model.norm = InPlaceNorm()
    model.norm_output = norm_output
    return model


class TestEagle3DraftHandsOnItsCapture(CustomTestCase):
    def test_the_draft_hands_on_its_capture_without_a_copy(self):
        for norm_output in (False, True):
            with self.subTest(norm_output=norm_output):
                stream = torch.randn(TOKENS, HIDDEN)
                embeds = torch.randn(TOKENS, HIDDEN)
                batch = forward_batch(
                    spec_info=types.SimpleNamespace(hidden_states=stream.clone())
                )
                model = _eagle3_draft(norm_output)
                normed = []
                model.norm.register_forward_hook(
                    lambda module, args, out: normed.append(out)
                )
                hidden, aux = model(None, None, batch, input_embeds=embeds)
                # The fused add + norm: residual stream + layer output, then halved.
                pre_norm = 2 * stream + embeds
                want = pre_norm * 0.5 if norm_output else pre_norm
                self.assertIsInstance(aux, torch.Tensor)
                self.assertIs(pack_aux_hidden_states(aux), aux)
                torch.testing.assert_close(aux, want)
                torch.testing.assert_close(hidden, pre_norm * 0.5)
                # K = 1 is packed already: the final norm's output itself.
                (out,) = normed
                self.assertIs(aux, out[0] if norm_output else out[1])

    def test_an_idle_draft_batch_hands_on_no_tokens(self):
        batch = forward_batch(
            spec_info=types.SimpleNamespace(hidden_states=torch.empty(0, HIDDEN))
        )
        hidden, aux = _eagle3_draft(False)(
            None, None, batch, input_embeds=torch.empty(0, HIDDEN)
        )
        self.assertEqual(tuple(pack_aux_hidden_states(aux).shape), (0, HIDDEN))


class TestListPathDeprecated(CustomTestCase):
    def setUp(self):
        aux_hidden_states._list_deprecation_warned = False

    def test_in_tree_models_capture_into_the_packer(self):
        self.assertIs(
            aux_hidden_states.AuxHiddenStateAccumulator,
            aux_hidden_states.AuxHiddenStatePacker,
        )

    def test_a_list_is_concatenated_once_with_one_warning(self):
        captures = [torch.randn(TOKENS, HIDDEN) for _ in range(3)]
        packed = torch.cat(captures, dim=-1)
        self.assertIs(pack_aux_hidden_states(packed), packed)
        with self.assertLogs(aux_hidden_states.logger, "WARNING") as logs:
            torch.testing.assert_close(pack_aux_hidden_states(captures), packed)
            self.assertIs(pack_aux_hidden_states(captures[:1]), captures[0])
        self.assertEqual(len(logs.records), 1)
        self.assertIn("AuxHiddenStatePacker", logs.records[0].getMessage())

    def test_the_deprecated_list_still_collects(self):
        borrowed, owned = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
        with self.assertLogs(aux_hidden_states.logger, "WARNING"):
            collected = aux_hidden_states.AuxHiddenStateList()
        collected.capture(borrowed)
        collected.capture(owned, owned=True)
        torch.testing.assert_close(collected[0], borrowed)
        self.assertNotEqual(collected[0].data_ptr(), borrowed.data_ptr())
        self.assertIs(collected[1], owned)


if __name__ == "__main__":
    unittest.main()
