# upstream-path: test/registered/spec/test_stage_capture_gather_scattered.py
"""An attention stage's aux capture covers every token when its input is scattered.

With attention TP input scattering (--enable-attn-tp-input-scattered, allowed
for DFlash) each TP rank holds its share of the tokens at the attention input,
and a q-lora attention gathers them only after its projection: the entry has no
input_move. StageBoundary._prepare_attention must still hand capture_gathered
the layer output of every token of the batch, or the capture cannot be packed
with a final-layer capture (taken where the residual covers every token again)
nor indexed with batch-wide positions by the logits processor.

Runs on CPU in one process: the stages are the real ones, bound for TP = 2
with scattering configured; SGLang's own AttnTpContext decides the batch is
scattered (only its CUDA platform gate is answered yes). The TP group is a
stand-in for rank 0 of two: the other rank contributes nothing to a
reduce-scatter and holds the other half of the layer output in an all-gather.
"""

import types
import unittest
from unittest import mock

import torch

from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker
from sglang.srt.layers.layer_boundary.adapters import attention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.boundary_fixtures import (
    Norm,
    make_test_stages,
    parallel_of,
    planning,
    prepare_attention,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

TP = 2
TOKENS = 6
HIDDEN = 4


class _RankZeroGroup:
    """The TP group as rank 0 of ``TP`` ranks sees it.

    The other rank's partial sums are zero, and its share of the gathered rows
    is ``other`` (set by the test: the rows of the layer output it holds).
    """

    def __init__(self):
        self.other = None
        self.gathered = []

    def reduce_scatter_tensor(self, output, input_):
        output.copy_(input_.tensor_split(TP)[0])

    def all_gather_into_tensor(self, output, input_):
        self.gathered.append(input_.clone())
        output.copy_(torch.cat([input_, self.other], dim=0))


def _forward_batch(extend):
    return types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
        input_ids=torch.zeros(TOKENS, dtype=torch.long),
        can_run_tbo=False,
        residual_stream=None,
    )


class TestStageCaptureGatherScattered(unittest.TestCase):
    def setUp(self):
        self.group = _RankZeroGroup()
        parallel = parallel_of(
            attn_dp=1,
            attn_tp=TP,
            enable_attn_tp_input_scattered=True,
            tp_group=self.group,
        )
        planning_scope = planning(parallel)
        planning_scope.__enter__()
        self.addCleanup(planning_scope.__exit__, None, None, None)
        # The attention-TP gather of the layout's moves, over the same group.
        gather_scope = mock.patch.object(
            attention,
            "attn_tp_all_gather_into_tensor",
            self.group.all_gather_into_tensor,
        )
        gather_scope.start()
        self.addCleanup(gather_scope.stop)
        # The stages bind the input-scattered variant at construction, and a
        # q-lora attention (with a QKV hook) gathers after its projection.
        self.stages = make_test_stages(
            attention_norm=Norm(),
            ffn_norm=Norm(),
            qkv_latent_func=lambda hidden_states, forward_batch: hidden_states,
        )
        ctx = attention.get_attn_tp_context()
        saved = (ctx.allow_input_scattered, ctx.is_dsa)
        self.addCleanup(setattr, ctx, "is_dsa", saved[1])
        self.addCleanup(setattr, ctx, "allow_input_scattered", saved[0])
        with mock.patch.object(attention, "_is_cuda", True):
            ctx.init_context(q_lora_rank=8, is_dsa=False)
        self.assertTrue(ctx.allow_input_scattered)
        self.ctx = ctx

    def _prepare(self, collector, extend):
        forward_batch = _forward_batch(extend)
        hidden = torch.randn(TOKENS, HIDDEN)
        residual = torch.randn(TOKENS, HIDDEN)
        # Norm's residual output is the previous layer's output: hidden + residual.
        layer_output = hidden + residual
        self.group.other = layer_output.tensor_split(TP)[1]
        with self.ctx.maybe_input_scattered(forward_batch):
            self.assertEqual(self.ctx.input_scattered, extend)
            _, stream = prepare_attention(
                self.stages.attn,
                hidden,
                residual,
                forward_batch,
                capture_gathered=collector,
            )
        return layer_output, stream.residual

    def test_scattered_capture_covers_every_token(self):
        aux = AuxHiddenStatePacker(1)
        layer_output, local_residual = self._prepare(aux, extend=True)
        # This rank keeps its share of the tokens in the residual ...
        self.assertEqual(local_residual.shape[0], TOKENS // TP)
        torch.testing.assert_close(local_residual, layer_output.tensor_split(TP)[0])
        # ... and captures all of them, gathered over the TP group.
        capture = aux.finalize()
        self.assertEqual(tuple(capture.shape), (TOKENS, HIDDEN))
        torch.testing.assert_close(capture, layer_output)
        torch.testing.assert_close(self.group.gathered[-1], local_residual)
        # The collector keeps the gathered rows: later in-place updates of the
        # residual do not reach them.
        local_residual.add_(1.0)
        torch.testing.assert_close(capture, layer_output)

    def test_scattered_capture_packs_with_final_layer_capture(self):
        aux = AuxHiddenStatePacker(2)
        layer_output, _ = self._prepare(aux, extend=True)
        # The final norm's capture covers every token of the batch.
        final_output = torch.randn(TOKENS, HIDDEN)
        aux.capture(final_output, owned=True)
        packed = aux.finalize()
        self.assertEqual(tuple(packed.shape), (TOKENS, 2 * HIDDEN))
        torch.testing.assert_close(packed[:, :HIDDEN], layer_output)
        torch.testing.assert_close(packed[:, HIDDEN:], final_output)

    def test_unscattered_capture_is_the_residual(self):
        # A decode batch is not scattered: the residual covers every token, and
        # the capture takes it as it is.
        aux = AuxHiddenStatePacker(1)
        layer_output, residual = self._prepare(aux, extend=False)
        capture = aux.finalize()
        self.assertEqual(tuple(capture.shape), (TOKENS, HIDDEN))
        torch.testing.assert_close(capture, residual)
        torch.testing.assert_close(capture, layer_output)
        self.assertEqual(self.group.gathered, [])

    def test_capture_gather_owns_its_buffer_only_as_the_last_step(self):
        # The capture move's attention-TP gather takes a buffer of its own where it
        # ends the move (pure attention TP: the capture outlives the local DP
        # buffer); before an attention-DP gather, which copies its rows out at once,
        # it stays in the local DP buffer.
        from sglang.srt.layers.layer_boundary import boundary, ops
        from sglang.srt.layers.layer_boundary.layout import Layout, TokenAxis

        for axes, want in (
            ({TokenAxis.ATTN_TP}, [("tp", True)]),
            ({TokenAxis.ATTN_TP, TokenAxis.ATTN_DP}, [("tp", False), ("dp", None)]),
        ):
            with self.subTest(axes=sorted(a.name for a in axes)):
                calls = []

                def tp_gather(tensor, *, owned=False):
                    calls.append(("tp", owned))
                    return torch.cat([tensor, tensor])

                def dp_gather(tensor, forward_batch, cp_shard_counts=None):
                    calls.append(("dp", None))
                    return tensor.clone()

                edge = types.SimpleNamespace(
                    residual_to=Layout(sharded=frozenset(axes)),
                    produced=types.SimpleNamespace(layout=Layout(sharded=frozenset())),
                )
                with (
                    mock.patch.object(ops, "attn_tp_gather", tp_gather),
                    mock.patch.object(ops, "dp_gather", dp_gather),
                ):
                    move, _ = boundary._capture_move(edge)
                    out = move(torch.ones(3, HIDDEN), forward_batch=None)
                self.assertEqual(tuple(out.shape), (6, HIDDEN))
                self.assertEqual(calls, want)


if __name__ == "__main__":
    unittest.main()
