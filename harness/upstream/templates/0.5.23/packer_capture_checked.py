# upstream-path: test/registered/unit/layers/test_aux_hidden_state_packer_checks.py
"""AuxHiddenStatePacker checks every capture against the first.

A later capture with another leading shape or width (a [1, H] capture after
[T, H] ones) used to broadcast into every token's slot; a capture past the
K expected ones counted on. Both are refused before anything is written,
and consistent captures still pack like torch.cat and trace with
torch.compile(fullgraph=True).

Runs on CPU without a GPU or a model.
"""

import unittest

import torch

from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

T, H, K = 5, 4, 3


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
                        torch.equal(packer._buffer.view(torch.int32), before.view(torch.int32))
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
