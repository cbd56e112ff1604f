# upstream-path: test/registered/unit/models/test_aux_packer_fused_loops.py
"""Models with looped or fused forwards pack their EAGLE3/DFlash aux
hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). These language models collect
into AuxHiddenStatePacker instead, each capture written once into its slot of
one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged:

- NanbeigeModel, a looped model whose capture ids are unrolled
  (loop_idx * num_hidden_layers + i), with or without the norm between loops;
- InklingCausalLLM, whose taps are taken before each layer's deferred short
  convolution;
- BeamModel, in its plain loop and in its fused loop (``layer.forward_fused``);
- MuseSpark1xModel, whose float32 stream is cast into operator-dtype slots.

A DFlash decode CUDA graph passes a slice of one shared buffer on the batch
(``aux_hidden_states_buffer``), which the forward fills in place; it is sized
by the CausalLM's get_aux_hidden_states_width, K * hidden while capturing.

Every test runs over every model of the table below. Runs on CPU without a GPU
or a checkpoint: each model's forward, CausalLM and setters are the real ones;
the decoder layers and norms are small stand-ins on the real residual stream
(Beam: its real decoder layers, with the attention and MLP stood in), and the
expected captures follow from the stand-ins' arithmetic.
"""

import types
import unittest
from unittest import mock

import torch
from torch import nn

from sglang.srt.configs.beam import BeamConfig
from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.layout import SumGroup
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.residual.short_conv import ShortConvUpdate
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import beam
from sglang.srt.models.beam import BeamDecoderLayer, BeamForCausalLM, BeamModel
from sglang.srt.models.inkling import (
    InklingCausalLLM,
    InklingForConditionalGeneration,
    _inkling_read,
)
from sglang.srt.models.muse_spark import (
    MuseSpark1xModel,
    MuseSparkModel,
    MuseSparkTextForCausalLM,
)
from sglang.srt.models.nanbeige import NanbeigeForCausalLM, NanbeigeModel
from sglang.test.aux_capture_test_utils import (
    InPlaceNorm,
    StreamLayer,
    forward_batch,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
NUM_LOOPS = 2  # Nanbeige: unrolled capture ids 0 .. NUM_LOOPS * NUM_LAYERS


# --- shared scaffolding -------------------------------------------------------


def _stub(cls):
    """``cls`` without its __init__ (no checkpoint, no process groups): each
    family sets the attributes its real forward and setters read."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module


def _pp(first=True, last=True):
    return types.SimpleNamespace(is_first_rank=first, is_last_rank=last, world_size=1)


def _batch(tokens, buffer=None):
    """What the forwards read of a ForwardBatch; an empty batch is idle."""
    return forward_batch(
        ForwardMode.EXTEND if tokens else ForwardMode.IDLE,
        buffer,
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.arange(tokens),
    )


def _forward(model, embeds, extra, buffer=None):
    batch = _batch(embeds.shape[0], buffer)
    with torch.no_grad():
        return model.forward(
            input_ids=None,
            positions=batch.positions,
            forward_batch=batch,
            input_embeds=embeds.clone(),
            **extra,
        )


def _nan_buffer(rows, width, dtype):
    return torch.full((rows, width), float("nan"), dtype=dtype)


def _stream_layers():
    # On the real residual stream (Nanbeige): layer k adds k + 1 in
    # every loop.
    return nn.ModuleList(StreamLayer(i) for i in range(NUM_LAYERS))


def _convolve(hidden_states, positions, forward_batch):
    # A channelwise stand-in for Inkling's short convolution.
    return hidden_states * 2.0


class _ConvLayer(nn.Module):
    """InklingDecoderLayer's boundary: applies the previous layer's deferred
    convolution at its entry (conv of the contribution plus the residual, written
    as the stream), then leaves ``layer_id + 1`` as its contribution with its own
    convolution deferred to the next boundary."""

    def __init__(self, layer_id, scattered_sconv=False):
        super().__init__()
        self.layer_id = layer_id
        self.scattered_sconv = scattered_sconv
        # A one-rank group: all_gather_hidden hands the shard back as it is.
        self.attn_tp_group = types.SimpleNamespace(world_size=1)
        self.mlp_sconv = None
        self.mlp_ar_fusable = False

    def forward(self, hidden_states, positions, forward_batch, **unused_kwargs):
        if forward_batch.forward_mode.is_idle():
            return hidden_states
        stream = residual_batch.stream_of(forward_batch)
        value, residual = stream.input(hidden_states)
        if stream.pending is not None:
            value = stream.pending.update.update(stream.pending.complete(), residual)
        value = stream.write(value)
        update = ShortConvUpdate(_convolve, None, SumGroup.TP).bind(forward_batch)
        contribution = torch.full_like(value, float(self.layer_id + 1))
        return stream.record(contribution, update)


class _MuseLayer(nn.Module):
    """MuseSpark1xDecoderLayer's interface: adds ``layer_id + 1`` to the float32
    stream in place and returns it with the next layer's attention input in
    operator dtype (None after the last)."""

    def __init__(self, layer_id, operator_dtype):
        super().__init__()
        self.layer_id = layer_id
        self.operator_dtype = operator_dtype

    def self_attn_input_norm(self, stream):
        return stream.to(self.operator_dtype)

    def forward(self, positions, stream, attn_input, forward_batch):
        stream.add_(float(self.layer_id + 1))
        if self.layer_id == NUM_LAYERS - 1:
            return stream, None
        return stream, self.self_attn_input_norm(stream)


class _BeamAttention(nn.Module):
    """Stands in for BeamAttention: a fixed per-layer linear map."""

    def __init__(self, config, layer_id, quant_config=None, prefix="", rotary_emb=None):
        super().__init__()
        g = torch.Generator().manual_seed(100 + layer_id)
        self.weight = torch.randn(config.hidden_size, config.hidden_size, generator=g)

    def forward(self, positions, hidden_states, forward_batch, ssmax_scale, **unused):
        return hidden_states @ self.weight


class _BeamMLP(nn.Module):
    """Stands in for BeamMLP: ``tanh`` of a fixed per-layer linear map."""

    def __init__(self, config, prefix="", quant_config=None):
        super().__init__()
        g = torch.Generator().manual_seed(200 + int(prefix.split(".")[1]))
        self.weight = torch.randn(config.hidden_size, config.hidden_size, generator=g)

    def forward(self, x, skip_all_reduce=False):
        return torch.tanh(x @ self.weight)


# --- the group: how to build, run and predict each model ----------------------


class _Family:
    """One row of FAMILIES. ``ids``: capture ids in the model's own numbering, the
    last layer's output last; ``dflash_ids``: what the CausalLM's DFlash setter is
    given."""

    name = ""
    ids = (0, 2, NUM_LAYERS - 1)
    dflash_ids = (0, 2, NUM_LAYERS - 1)
    dtype = torch.float32  # of the captures and of the decode graph's buffer
    exact = False  # captures compared bit for bit
    idle_takes_captures = True  # an idle batch returns an empty packed buffer

    def build(self, ids=()):
        raise NotImplementedError

    def inputs(self, tokens=TOKENS):
        """The input embeddings, and any other forward input."""
        return torch.randn(tokens, HIDDEN).to(self.dtype), {}

    def reference(self, model, embeds, **extra):
        """The value of each capture id and the final hidden states."""
        raise NotImplementedError

    def causal_lm(self):
        raise NotImplementedError

    def language_model(self, lm):
        return lm.model


class _Nanbeige(_Family):
    # Unrolled ids in both loops, the first step of the second loop among them;
    # the last (DEPTH) is the last layer's output, taken at the final norm.
    DEPTH = NUM_LOOPS * NUM_LAYERS
    ids = (1, NUM_LAYERS, NUM_LAYERS + 2, DEPTH)
    dflash_ids = (0, NUM_LAYERS, DEPTH - 1)  # DFlash target ids are unrolled too

    def __init__(self, skip_loop_final_norm):
        self.skip_loop_final_norm = skip_loop_final_norm
        self.name = "NanbeigeModel" + (
            "/skip_loop_final_norm" if skip_loop_final_norm else ""
        )

    def _config(self):
        return types.SimpleNamespace(
            hidden_size=HIDDEN,
            num_hidden_layers=NUM_LAYERS,
            num_loops=NUM_LOOPS,
            skip_loop_final_norm=self.skip_loop_final_norm,
        )

    def build(self, ids=()):
        model = _stub(NanbeigeModel)
        model.config = self._config()
        model.layers = _stream_layers()
        model.start_layer, model.end_layer = 0, NUM_LAYERS
        model.layers_to_capture = list(ids)
        model.norm = InPlaceNorm()
        model.pp_group = _pp()
        return model

    def reference(self, model, embeds):
        # Unrolled id k: the stream entering step k; DEPTH: entering the final
        # norm. Between loops the norm halves the stream unless skipped.
        values, x = [], embeds
        for loop_idx in range(NUM_LOOPS):
            for j in range(NUM_LAYERS):
                values.append(x)
                x = x + float(j + 1)
            if loop_idx != NUM_LOOPS - 1 and not self.skip_loop_final_norm:
                x = x * 0.5
        return values + [x], x * 0.5

    def causal_lm(self):
        lm = _stub(NanbeigeForCausalLM)
        lm.model = self.build()
        lm.config = self._config()
        lm.pp_group = _pp()
        lm.capture_aux_hidden_states = False
        return lm


class _Inkling(_Family):
    # Layer outputs taken inside the loop, before the deferred convolution.
    name = "InklingCausalLLM"
    idle_takes_captures = False  # an idle batch takes none: aux is None

    def build(self, ids=()):
        model = _stub(InklingCausalLLM)
        model.config = types.SimpleNamespace(log_scaling_n_floor=None)
        model.layers = nn.ModuleList(
            _ConvLayer(i, scattered_sconv=(i == 2)) for i in range(NUM_LAYERS)
        )
        model.norm = InPlaceNorm()
        model._final_read = _inkling_read()
        model._dflash_layers_to_capture = set()
        if ids:
            model.set_dflash_layers_to_capture(list(ids))
        return model

    def reference(self, model, embeds):
        # Layer j's input stream is embeds + j * (j + 1) (each layer i adds its
        # convolved contribution 2 * (i + 1)); its tap is that plus j + 1. The
        # final read applies the last deferred convolution, then the norm.
        values = [embeds + float((j + 1) ** 2) for j in range(NUM_LAYERS)]
        return values, (embeds + float(NUM_LAYERS * (NUM_LAYERS + 1))) * 0.5

    def causal_lm(self):
        lm = _stub(InklingForConditionalGeneration)
        lm.llm = self.build()
        lm.text_config = types.SimpleNamespace(
            hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
        )
        return lm

    def language_model(self, lm):
        return lm.llm


class _Beam(_Family):
    # Layer outputs taken after each layer inside the loop, the last one's too.
    # On the CPU the fused loop's all-reduce replacements are off.

    def __init__(self, fused):
        self.fused = fused
        self.name = "BeamModel/" + ("fused" if fused else "plain")

    @staticmethod
    def _config():
        return BeamConfig(
            vocab_size=32,
            hidden_size=HIDDEN,
            intermediate_size=16,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            sliding_window=4,
            mlp_layer_types=["dense"] * NUM_LAYERS,
        )

    def build(self, ids=(), start_layer=0, end_layer=NUM_LAYERS):
        config = self._config()
        model = _stub(BeamModel)
        model.config = config
        parallel = types.SimpleNamespace(attn_dp_size=1)
        with (
            mock.patch.object(beam, "BeamAttention", _BeamAttention),
            mock.patch.object(beam, "BeamMLP", _BeamMLP),
            mock.patch.object(beam, "get_parallel", lambda: parallel),
        ):
            model.layers = nn.ModuleList(
                BeamDecoderLayer(config, i, prefix=f"layers.{i}")
                for i in range(NUM_LAYERS)
            )
        g = torch.Generator().manual_seed(7)
        for module in model.layers.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        model.start_layer, model.end_layer = start_layer, end_layer
        model.norm = RMSNorm(HIDDEN, eps=config.rms_norm_eps)
        model.norm.weight.data = torch.linspace(0.5, 1.5, HIDDEN)
        model.pp_group = _pp(start_layer == 0, end_layer == NUM_LAYERS)
        model.has_full_attention = True
        model.layers_to_capture = tuple(ids)
        model.fuse_moe_all_reduce = False
        model._beam_all_reduce_comm = None
        model.fuse_layers = self.fused
        model._flashinfer_ar_tokens = None
        model._flashinfer_ar = None
        model._mlp_has_single_tp_sum = True
        return model

    def reference(self, model, embeds):
        # Each layer's output by the layers' own unfused forward (not the model's).
        positions = torch.arange(embeds.shape[0])
        scale = beam.compute_ssmax_scale(positions)
        values, x = [], embeds
        with torch.no_grad():
            for layer in model.layers:
                x = layer(positions, x, _batch(embeds.shape[0]), scale)
                values.append(x)
            return values, model.norm(x)

    def causal_lm(self):
        lm = _stub(BeamForCausalLM)
        lm.model = self.build()
        lm.config = lm.model.config
        lm.capture_aux_hidden_states = False
        return lm


class _MuseSpark(_Family):
    # Layer outputs, taken from the float32 stream and cast into operator-dtype
    # slots (what the draft's context projection reads), bit for bit.
    name = "MuseSpark1xModel"
    dtype = torch.bfloat16  # the operator dtype
    exact = True

    def build(self, ids=()):
        model = _stub(MuseSpark1xModel)
        model.operator_dtype = self.dtype
        model.residual_dtype = torch.float32
        model.embed_norm = None
        model.layers = nn.ModuleList(
            _MuseLayer(i, self.dtype) for i in range(NUM_LAYERS)
        )
        model.norm = InPlaceNorm()
        model.layers_to_capture = list(ids)
        return model

    def inputs(self, tokens=TOKENS):
        # Large enough that the float32 sums round when cast back.
        return torch.randn(tokens, HIDDEN).mul(3.0).to(self.dtype), {}

    def reference(self, model, embeds):
        values, stream = [], embeds.to(torch.float32)
        for j in range(NUM_LAYERS):
            stream = stream + float(j + 1)
            values.append(stream.to(self.dtype))
        return values, values[-1] * 0.5

    def causal_lm(self):
        lm = _stub(MuseSparkTextForCausalLM)
        lm.model = _stub(MuseSparkModel)
        lm.model.language_model = self.build()
        lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
        lm.capture_aux_hidden_states = False
        return lm

    def language_model(self, lm):
        return lm.model.language_model


FAMILIES = (
    _Nanbeige(skip_loop_final_norm=False),
    _Nanbeige(skip_loop_final_norm=True),
    _Inkling(),
    _Beam(fused=False),
    _Beam(fused=True),
    _MuseSpark(),
)


class TestAuxPackerFusedForwards(CustomTestCase):
    def assertSameValues(self, family, actual, expected):
        # Shape and dtype included.
        tolerance = dict(rtol=0, atol=0) if family.exact else {}
        torch.testing.assert_close(actual, expected, **tolerance)

    def assertSameStorage(self, actual, buffer):
        self.assertIsInstance(actual, torch.Tensor)
        self.assertEqual(
            actual.untyped_storage().data_ptr(), buffer.untyped_storage().data_ptr()
        )

    def test_forward_returns_one_packed_buffer(self):
        for family in FAMILIES:
            with self.subTest(model=family.name):
                model = family.build(family.ids)
                embeds, extra = family.inputs()
                hidden, aux = _forward(model, embeds, extra)
                values, final = family.reference(model, embeds, **extra)
                self.assertIsInstance(aux, torch.Tensor)
                expected = torch.cat([values[i] for i in family.ids], dim=-1)
                self.assertSameValues(family, aux, expected)
                # The final norm's output, not the last capture.
                self.assertSameValues(family, hidden, final)
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        for family in FAMILIES:
            with self.subTest(model=family.name):
                ids = (family.ids[0], family.ids[-1])
                model = family.build(ids)
                embeds, extra = family.inputs()
                shared = _nan_buffer(TOKENS + 3, len(ids) * HIDDEN, family.dtype)
                _, aux = _forward(model, embeds, extra, buffer=shared[:TOKENS])
                self.assertSameStorage(aux, shared)
                values, _ = family.reference(model, embeds, **extra)
                expected = torch.cat([values[i] for i in ids], dim=-1)
                self.assertSameValues(family, shared[:TOKENS], expected)
                # Rows past this batch's tokens are left as they were.
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_buffer_of_another_dtype_is_refused(self):
        # MuseSpark's float32 stream must not fill a float32 buffer: its captures
        # are operator dtype, what the draft reads. Nor any model's a buffer of
        # another dtype than its captures'.
        for family in FAMILIES:
            with self.subTest(model=family.name):
                other = torch.float32 if family.dtype != torch.float32 else torch.half
                shared = torch.zeros(TOKENS, 2 * HIDDEN, dtype=other)
                model = family.build((family.ids[0], family.ids[-1]))
                embeds, extra = family.inputs()
                with self.assertRaises(ValueError):
                    _forward(model, embeds, extra, buffer=shared)

    def test_idle_batch(self):
        for family in FAMILIES:
            with self.subTest(model=family.name):
                embeds, extra = family.inputs(tokens=0)
                hidden, aux = _forward(family.build(family.ids), embeds, extra)
                self.assertEqual(tuple(hidden.shape), (0, HIDDEN))
                if family.idle_takes_captures:
                    self.assertIsInstance(aux, torch.Tensor)
                    width = len(family.ids) * HIDDEN
                    self.assertEqual(tuple(aux.shape), (0, width))
                else:
                    self.assertIsNone(aux)

    def test_no_capture_returns_hidden_states_alone(self):
        for family in FAMILIES:
            with self.subTest(model=family.name):
                model = family.build()
                embeds, extra = family.inputs()
                out = _forward(model, embeds, extra)
                self.assertIsInstance(out, torch.Tensor)
                _, final = family.reference(model, embeds, **extra)
                self.assertSameValues(family, out, final)

    def test_causal_lm_reports_the_packed_width(self):
        for family in FAMILIES:
            with self.subTest(model=family.name):
                lm = family.causal_lm()
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture(list(family.dflash_ids))
                width = lm.get_aux_hidden_states_width()
                self.assertEqual(width, len(family.dflash_ids) * HIDDEN)
                # The decode graph runner sizes its one buffer by that width:
                # the language model fills it exactly.
                embeds, extra = family.inputs()
                shared = _nan_buffer(TOKENS, width, family.dtype)
                _, aux = _forward(family.language_model(lm), embeds, extra, shared)
                self.assertSameStorage(aux, shared)
                self.assertFalse(torch.isnan(shared).any())

    def test_beam_pipeline_stage_counts_its_own_layers(self):
        # A stage packs the listed outputs of its own layers only.
        family = _Beam(fused=True)
        stage = family.build((0, 2, NUM_LAYERS - 1), start_layer=1, end_layer=3)
        self.assertEqual(stage.num_aux_captures(), 1)
        self.assertEqual(family.build((0, 1)).num_aux_captures(), 2)


if __name__ == "__main__":
    unittest.main()
