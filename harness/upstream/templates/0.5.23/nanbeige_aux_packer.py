# upstream-path: test/registered/unit/models/test_nanbeige_aux_packer.py
"""NanbeigeModel packs its DFlash aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). NanbeigeModel, a looped model
whose capture ids are unrolled (loop_idx * num_hidden_layers + i, the last one
taken at the final norm), collects into AuxHiddenStatePacker instead: each
capture is copied once into its slot of one [T, K * H] buffer, which is what
the forward returns and what pack_aux_hidden_states hands on unchanged. A
DFlash decode CUDA graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by
NanbeigeForCausalLM.get_aux_hidden_states_width.

Runs on CPU without a GPU or a checkpoint: the decoder layers and the norm are
small stand-ins on the real residual stream (``forward_batch.residual_stream``);
NanbeigeModel.forward is the real one.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.nanbeige import NanbeigeForCausalLM, NanbeigeModel
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 3  # physical layers
NUM_LOOPS = 2
DEPTH = NUM_LOOPS * NUM_LAYERS  # unrolled: capture ids 0 .. DEPTH


class _Layer(nn.Module):
    """Completes the previous step's output at its boundary, captures it when
    asked (``capture_output``, as the decoder layer's attention boundary takes
    it), and adds ``layer_id + 1`` for the next boundary, in every loop."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self, positions, hidden_states, forward_batch, loop_idx, capture_output=None
    ):
        hidden_states = residual_batch.fold(hidden_states, forward_batch)
        if capture_output is not None:
            capture_output(hidden_states)
        contribution = torch.full_like(hidden_states, float(self.layer_id + 1))
        return residual_batch.stream_of(forward_batch).record(contribution, PLAIN_ADD)


class _Norm(nn.Module):
    """Halves its input, in place like a fused kernel: alone between loops,
    with the residual added first (both updated) as the final norm."""

    def forward(self, hidden_states, residual=None):
        if residual is None:
            return hidden_states.mul_(0.5)
        residual.add_(hidden_states)
        hidden_states.copy_(residual * 0.5)
        return hidden_states, residual


def _model(layers_to_capture=(), skip_loop_final_norm=False):
    model = NanbeigeModel.__new__(NanbeigeModel)
    nn.Module.__init__(model)
    model.config = types.SimpleNamespace(
        num_hidden_layers=NUM_LAYERS,
        num_loops=NUM_LOOPS,
        skip_loop_final_norm=skip_loop_final_norm,
    )
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = list(layers_to_capture)
    model.norm = _Norm()
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return model


def _run(model, embeds, buffer=None):
    forward_batch = types.SimpleNamespace(
        can_run_tbo=False,
        residual_stream=None,
        forward_mode=ForwardMode.EXTEND,
        aux_hidden_states_buffer=buffer,
    )
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch,
        input_embeds=embeds,
    )


def _unrolled(embeds, skip_loop_final_norm=False):
    """The stream entering every unrolled step (index k = capture id k), and
    last (id DEPTH) the stream entering the final norm."""
    values, x = [], embeds
    for loop_idx in range(NUM_LOOPS):
        for i in range(NUM_LAYERS):
            values.append(x)
            x = x + float(i + 1)
        if loop_idx != NUM_LOOPS - 1 and not skip_loop_final_norm:
            x = x * 0.5  # the norm between loops
    return values + [x]


class TestNanbeigeAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # Ids in both loops, the first step of the second loop among them; the
        # last unrolled id is the last layer's output, taken at the final norm.
        layers_to_capture = [1, NUM_LAYERS, NUM_LAYERS + 2, DEPTH]
        for skip in (False, True):
            with self.subTest(skip_loop_final_norm=skip):
                embeds = torch.randn(TOKENS, HIDDEN)
                hidden, aux = _run(_model(layers_to_capture, skip), embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(
                    tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN)
                )
                values = _unrolled(embeds, skip)
                expected = torch.cat([values[i] for i in layers_to_capture], dim=-1)
                torch.testing.assert_close(aux, expected)
                torch.testing.assert_close(hidden, values[DEPTH] * 0.5)
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layers_to_capture = [2, DEPTH]
        embeds = torch.randn(TOKENS, HIDDEN)
        shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
        _, aux = _run(_model(layers_to_capture), embeds.clone(), shared[:TOKENS])
        self.assertEqual(
            aux.untyped_storage().data_ptr(), shared.untyped_storage().data_ptr()
        )
        values = _unrolled(embeds)
        torch.testing.assert_close(
            shared[:TOKENS], torch.cat([values[i] for i in layers_to_capture], dim=-1)
        )
        self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        out = _run(_model(), torch.randn(TOKENS, HIDDEN))
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width(self):
        lm = NanbeigeForCausalLM.__new__(NanbeigeForCausalLM)
        nn.Module.__init__(lm)
        lm.model = _model()
        lm.config = types.SimpleNamespace(
            hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS, num_loops=NUM_LOOPS
        )
        lm.pp_group = types.SimpleNamespace(is_last_rank=True)
        lm.capture_aux_hidden_states = False
        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
        # DFlash target ids are unrolled too: the last is DEPTH - 1.
        lm.set_dflash_layers_to_capture([0, NUM_LAYERS, DEPTH - 1])
        self.assertEqual(lm.get_aux_hidden_states_width(), 3 * HIDDEN)


if __name__ == "__main__":
    unittest.main()
