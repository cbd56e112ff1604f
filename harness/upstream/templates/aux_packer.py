# upstream-path: test/registered/spec/test_aux_hidden_state_packer.py
"""AuxHiddenStatePacker packs K captures into one [tokens, K * hidden] buffer.

It is a drop-in for the list the model collects EAGLE3/DFlash captures into:
the logits processor then needs no torch.cat, which held the list and the
concatenation at once (a transient ~2x spike of K * tokens * hidden).
"""

import unittest

import torch

from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestAuxHiddenStatePacker(unittest.TestCase):
    def test_packs_like_cat(self):
        caps = [torch.randn(5, 4) for _ in range(3)]
        packer = AuxHiddenStatePacker(3)
        for c in caps:
            packer.append(c)
        torch.testing.assert_close(packer.finalize(), torch.cat(caps, dim=-1))

    def test_append_copies(self):
        cap = torch.randn(5, 4)
        packer = AuxHiddenStatePacker(1)
        packer.append(cap)
        cap.add_(1.0)  # later in-place updates must not reach the packed buffer
        self.assertFalse(torch.equal(packer.finalize(), cap))
        self.assertTrue(getattr(AuxHiddenStatePacker, "copies_on_append", True))

    def test_finalize_with_wrong_count_fails(self):
        packer = AuxHiddenStatePacker(2)
        packer.append(torch.randn(5, 4))
        with self.assertRaises(Exception):
            packer.finalize()


if __name__ == "__main__":
    unittest.main()
