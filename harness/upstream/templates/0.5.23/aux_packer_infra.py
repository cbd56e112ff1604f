# upstream-path: test/registered/unit/layers/test_aux_packer_infra.py
"""What every model moved onto AuxHiddenStatePacker shares.

count_aux_captures: K, the captures one pipeline stage packs, counted as the
layer loops take them (each distinct id in [start_layer, end_layer] once; an
id another stage owns is not this stage's). AuxCaptureCountMixin gives a
model that count; AuxHiddenStatesWidthMixin gives its CausalLM the packed
width a DFlash decode CUDA graph sizes its shared buffer by.
AuxHiddenStatePacker.slot(like, dtype=) hands out a slot of another dtype
than the value it is shaped like, for a producer that casts into it.

The packer checks every capture against the first: a later capture with
another leading shape or width (a [1, H] capture after [T, H] ones) used to
broadcast into every token's slot, and a capture past the K expected ones
counted on. Both are refused before anything is written, and consistent
captures still pack like torch.cat and trace with torch.compile(fullgraph=True).

Runs on CPU without a GPU or a model.
"""

import types
import unittest

import torch

from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
T, H, K = 5, 4, 3


# The helpers are looked up when a test runs, not at import: on a release without
# them each test fails on its own, and the packer's checks still run.
def _Model(start_layer, end_layer, layers_to_capture):
    model = type("_Model", (aux_hidden_states.AuxCaptureCountMixin,), {})()
    model.start_layer, model.end_layer = start_layer, end_layer
    model.layers_to_capture = layers_to_capture
    return model


def _CausalLM(model, capture):
    lm = type("_CausalLM", (aux_hidden_states.AuxHiddenStatesWidthMixin,), {})()
    lm.model = model
    lm.capture_aux_hidden_states = capture
    lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
    return lm


class TestAuxPackerInfra(CustomTestCase):
    def test_count_is_the_distinct_ids_of_the_stage(self):
        cases = (
            # (ids, start_layer, end_layer, K)
            (None, 0, 4, 0),
            ([], 0, 4, 0),
            ([1, 2, 4], 0, 4, 3),  # 4: the last layer's output, after the loop
            ([2, 2, 3], 0, 4, 2),  # the loop takes layer 2's input once
            ([0, 3, 6], 0, 4, 2),  # 6 is no layer of this stage
            ([1, 3, 6], 2, 6, 2),  # the second of two stages: 1 is the first's
            ([1, 3, 6], 0, 2, 1),
        )
        for ids, start, end, k in cases:
            with self.subTest(ids=ids, start=start, end=end):
                self.assertEqual(
                    aux_hidden_states.count_aux_captures(ids, start, end), k
                )
                self.assertEqual(_Model(start, end, ids).num_aux_captures(), k)

    def test_count_mixin_on_a_model_that_never_set_ids(self):
        model = _Model(0, 4, None)
        del model.layers_to_capture
        self.assertEqual(model.num_aux_captures(), 0)

    def test_width_is_k_hidden_while_capturing(self):
        model = _Model(0, 4, [1, 2, 4])
        self.assertEqual(
            _CausalLM(model, True).get_aux_hidden_states_width(), 3 * HIDDEN
        )
        self.assertEqual(_CausalLM(model, False).get_aux_hidden_states_width(), 0)
        # A subclass whose model does not pack (an MTP draft, another backbone).
        self.assertEqual(_CausalLM(object(), True).get_aux_hidden_states_width(), 0)
        lm = _CausalLM(model, True)
        del lm.capture_aux_hidden_states
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)

    def test_slot_in_another_dtype_packs_like_cat_of_casts(self):
        caps = [torch.randn(5, HIDDEN) for _ in range(3)]
        packer = AuxHiddenStatePacker(3)
        for cap in caps:
            packer.slot(cap, dtype=torch.bfloat16).copy_(cap)
        packed = packer.finalize()
        self.assertEqual(packed.dtype, torch.bfloat16)
        expected = torch.cat([c.to(torch.bfloat16) for c in caps], dim=-1)
        self.assertTrue(torch.equal(packed, expected))

    def test_slot_dtype_must_match_a_given_buffer(self):
        out = torch.empty(5, 2 * HIDDEN, dtype=torch.bfloat16)
        packer = AuxHiddenStatePacker(2, out=out)
        with self.assertRaisesRegex(ValueError, "captures need"):
            packer.slot(torch.randn(5, HIDDEN), dtype=torch.float32)
        packer = AuxHiddenStatePacker(2, out=out)
        cap = torch.randn(5, HIDDEN)
        packer.slot(cap, dtype=torch.bfloat16).copy_(cap)
        packer.slot(cap, dtype=torch.bfloat16).copy_(cap)
        self.assertEqual(packer.finalize().data_ptr(), out.data_ptr())

    def test_slot_with_dtype_traces_fullgraph(self):
        caps = [torch.randn(5, HIDDEN) for _ in range(2)]

        def pack(a, b):
            packer = AuxHiddenStatePacker(2)
            for x in (a, b):
                packer.slot(x, dtype=torch.bfloat16).copy_(x * 2)
            return packer.finalize()

        torch._dynamo.reset()
        compiled = torch.compile(pack, backend="eager", fullgraph=True)
        expected = torch.cat([(c * 2).to(torch.bfloat16) for c in caps], dim=-1)
        self.assertTrue(torch.equal(compiled(*caps), expected))


class TestAuxHiddenStatePackerChecks(CustomTestCase):
    def test_later_capture_unlike_the_first_is_refused(self):
        for later in ((1, H), (T - 1, H), (T, H + 1), (2, T, H)):
            for take in ("append", "slot"):
                with self.subTest(later=later, take=take):
                    packer = AuxHiddenStatePacker(K)
                    packer.append(torch.randn(T, H))
                    before = packer._buffer.clone()
                    with self.assertRaisesRegex(ValueError, "the first was"):
                        getattr(packer, take)(torch.randn(*later))
                    # Bitwise: the slots not yet written are uninitialised
                    # memory, which may hold NaN (never equal to itself).
                    self.assertTrue(
                        torch.equal(
                            packer._buffer.view(torch.int32), before.view(torch.int32)
                        )
                    )
                    self.assertEqual(len(packer), 1)

    def test_capture_past_the_expected_count_is_refused(self):
        for out in (None, torch.empty(T, K * H)):
            with self.subTest(graph_buffer=out is not None):
                packer = AuxHiddenStatePacker(K, out=out)
                caps = [torch.randn(T, H) for _ in range(K)]
                for cap in caps:
                    packer.append(cap)
                with self.assertRaisesRegex(RuntimeError, f"only {K} expected"):
                    packer.append(torch.randn(T, H))
                self.assertTrue(torch.equal(packer.finalize(), torch.cat(caps, -1)))

    def test_consistent_captures_trace_fullgraph(self):
        caps = [torch.randn(T, H) for _ in range(K)]

        def pack(a, b, c):
            packer = AuxHiddenStatePacker(K)
            for x in (a, b, c):
                packer.append(x * 2)
            return packer.finalize()

        torch._dynamo.reset()
        compiled = torch.compile(pack, backend="eager", fullgraph=True)
        expected = torch.cat([c * 2 for c in caps], dim=-1)
        self.assertTrue(torch.equal(compiled(*caps), expected))


if __name__ == "__main__":
    unittest.main()
