# upstream-path: test/registered/spec/test_communicator_capture_gather_scattered.py
"""LayerCommunicator captures cover every token when the layer input is scattered.

With attention TP input scattering (--enable-attn-tp-input-scattered) prepare_attn
reduce-scatters the tokens, and with SGLANG_USE_AG_AFTER_QLORA a scattered layer
input stays scattered for attention. An aux hidden state captured there must still
be gathered to all tokens of the attention TP group, or it cannot be packed with
the full-size captures of other layers.

Runs on CPU in one process: the TP group is a stand-in that all-gathers the shards
of two simulated ranks; LayerCommunicator's capture path is the real one.
"""

import types
import unittest
from unittest import mock

import torch

from sglang.srt.layers import communicator
from sglang.srt.layers.communicator import (
    CommunicateSimpleFn,
    LayerCommunicator,
    LayerScatterModes,
    ScatterMode,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

TP = 2
TOKENS = 6
HIDDEN = 4


class _TwoRankGroup:
    """all_gather_into_tensor over two ranks: rank 0 holds `mine`, rank 1 `other`."""

    def __init__(self, other):
        self.other = other

    def all_gather_into_tensor(self, output, input_):
        output.copy_(torch.cat([input_, self.other], dim=0))


def _communicator(layer_input_mode, capture_gathers=False):
    comm = LayerCommunicator.__new__(LayerCommunicator)
    comm.layer_scatter_modes = LayerScatterModes(
        layer_input_mode=layer_input_mode,
        attn_mode=ScatterMode.TP_ATTN_FULL,
        mlp_mode=ScatterMode.FULL,
        middle_residual_mode=ScatterMode.TP_ATTN_FULL,
        layer_output_mode=ScatterMode.TP_ATTN_FULL,
    )
    comm._context = types.SimpleNamespace(attn_tp_size=TP, tp_size=TP, tp_rank=0)
    comm._communicate_simple_fn = CommunicateSimpleFn._trivial
    comm._capture_gathers_scattered_input = capture_gathers
    return comm


class TestCaptureGatherScattered(unittest.TestCase):
    def setUp(self):
        self.full = torch.randn(TOKENS, HIDDEN)
        self.mine, self.other = self.full.tensor_split(TP)
        self.forward_batch = types.SimpleNamespace(input_ids=torch.zeros(TOKENS))

    def test_input_scattered_capture_is_all_gathered(self):
        comm = _communicator(ScatterMode.TP_ATTN_FULL)
        ctx = types.SimpleNamespace(input_scattered=True)
        with mock.patch.object(
            communicator, "get_attn_tp_context", return_value=ctx
        ), mock.patch.object(
            communicator, "get_tp_group", return_value=_TwoRankGroup(self.other)
        ):
            out = comm._gather_last_layer_output(self.mine, self.forward_batch)
        self.assertEqual(tuple(out.shape), (TOKENS, HIDDEN))
        torch.testing.assert_close(out, self.full)

    def test_ag_after_qlora_scattered_input_is_gathered(self):
        comm = _communicator(ScatterMode.SCATTERED, capture_gathers=True)
        ctx = types.SimpleNamespace(input_scattered=False)
        with mock.patch.object(
            communicator, "get_attn_tp_context", return_value=ctx
        ), mock.patch.object(
            CommunicateSimpleFn,
            "_scattered_to_tp_attn_full",
            side_effect=lambda h, fb, c: torch.cat([h, self.other], dim=0),
        ) as gather:
            out = comm._gather_last_layer_output(self.mine, self.forward_batch)
        gather.assert_called_once()
        torch.testing.assert_close(out, self.full)

    def test_full_layout_is_unchanged(self):
        comm = _communicator(ScatterMode.TP_ATTN_FULL)
        ctx = types.SimpleNamespace(input_scattered=False)
        with mock.patch.object(communicator, "get_attn_tp_context", return_value=ctx):
            out = comm._gather_last_layer_output(self.full, self.forward_batch)
        self.assertIs(out, self.full)


if __name__ == "__main__":
    unittest.main()
