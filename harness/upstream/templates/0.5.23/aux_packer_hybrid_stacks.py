# upstream-path: test/registered/unit/models/test_aux_packer_hybrid_stacks.py
"""The hybrid and linear-attention stacks pack their EAGLE3 / DFlash / DSpark aux
hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Qwen3NextModel, the Qwen3.5
bodies (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, InternS2MobiusForCausalLM),
GraniteMoeHybridModel, Glm5NextModel, MiniMaxM3Model, Lfm2Model, Lfm2MoeModel,
NemotronHModel, KimiLinearModel and BailingMoELinearModel collect into
AuxHiddenStatePacker instead: each capture, the last layer's included (before
or after the final norm), is copied once into its slot of one [T, K * H]
buffer, which is what the forward returns and what pack_aux_hidden_states
hands on unchanged. A DFlash-family decode CUDA graph passes a slice of one
shared buffer on the batch (aux_hidden_states_buffer), sized by the
get_aux_hidden_states_width of the class the model runner holds (the CausalLM,
or a multimodal wrapper around it).

Every test runs over every model of the table below: the captures are enabled
through the real setters with draft layer ids (id k is the output of layer k),
and the expected values follow from the stand-in layers' arithmetic. Runs on
CPU without a GPU or a checkpoint: the decoder layers (LFM2's mixers) and the
final norms are small stand-ins on the real residual stream
(``forward_batch.residual_stream``); each model's forward, each CausalLM and
wrapper, and their setters are the real ones.
"""

import contextlib
import types
import unittest
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import (
    pack_aux_hidden_states,
    set_final_layer_capture,
)
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layer_boundary.stage import StageBoundary
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardMode,
    PPProxyTensors,
)
from sglang.srt.model_executor.model_runner_components.misc_utils import (
    resolve_aux_hidden_states_width,
)
from sglang.srt.models import qwen3_5_text
from sglang.srt.models.bailing_moe_v3 import (
    BailingMoELinearModel,
    BailingMoeV3ForCausalLM,
)
from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration, Glm5NextModel
from sglang.srt.models.granitemoehybrid import (
    GraniteMoeHybridForCausalLM,
    GraniteMoeHybridModel,
)
from sglang.srt.models.interns2_mobius import InternS2MobiusForCausalLM
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM, KimiLinearModel
from sglang.srt.models.lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2Model
from sglang.srt.models.lfm2_moe import (
    Lfm2MoeDecoderLayer,
    Lfm2MoeForCausalLM,
    Lfm2MoeModel,
)
from sglang.srt.models.lfm2_vl import Lfm2VlForConditionalGeneration
from sglang.srt.models.minicpmv import MiniCPMV4_6, MiniCPMV4_6ForConditionalGeneration
from sglang.srt.models.minimax_m3 import MiniMaxM3Model, MiniMaxM3SparseForCausalLM
from sglang.srt.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
from sglang.srt.models.nano_nemotron_vl import NemotronH_Nano_VL_V2
from sglang.srt.models.nemotron_h import (
    NemotronHAttentionDecoderLayer,
    NemotronHForCausalLM,
    NemotronHMambaDecoderLayer,
    NemotronHMLPDecoderLayer,
    NemotronHModel,
    NemotronHMoEDecoderLayer,
)
from sglang.srt.models.nemotron_h_mtp import NemotronHForCausalLMMTP
from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextModel
from sglang.srt.models.qwen4_exp import (
    Qwen4ExpForConditionalGeneration,
    Qwen4ExpVLModel,
)
from sglang.srt.runtime_context import get_parallel
from sglang.test.aux_capture_test_utils import (
    InPlaceNorm,
    StreamLayer,
    expected_captures,
    forward_batch,
    stream_after,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
HC_MULT = 2
DFLASH = types.SimpleNamespace(is_dflash_family=lambda: True)


def _expected(embeds, layer_ids):
    # The outputs of these layers: capture indices k + 1.
    return expected_captures(embeds, [k + 1 for k in layer_ids])


def _stage(start_layer=0, end_layer=NUM_LAYERS):
    return types.SimpleNamespace(
        is_first_rank=start_layer == 0,
        is_last_rank=end_layer == NUM_LAYERS,
        world_size=1,
    )


# ---------------------------------------------------------------------------
# Stand-ins: decoder layers and final norms on the real residual stream.
# ---------------------------------------------------------------------------


class _FromPP:
    """A pipeline stage's entry: a fresh stream holding the received output."""

    def from_pp(self, pp_proxy_tensors, forward_batch):
        residual_batch.start(forward_batch)
        return pp_proxy_tensors["hidden_states"]


class _Layer(StreamLayer):
    """The scaffold's layer (either capture hook, called positionally or by
    keyword), and a pipeline stage's entry at its attention boundary."""

    def __init__(self, layer_id):
        super().__init__(layer_id)
        self.attn_boundary = _FromPP()


class _Glm5NextLayer(_Layer):
    """Returns ``(hidden, topk_indices)`` as Glm5NextDecoderLayer does."""

    def __init__(self, layer_id):
        super().__init__(layer_id)
        self.returns_topk = True


_NEMOTRON_H_LAYERS = (
    NemotronHMambaDecoderLayer,
    NemotronHMLPDecoderLayer,
    NemotronHAttentionDecoderLayer,
    NemotronHMoEDecoderLayer,
)


def _nemotron_h_layer(layer_id):
    """One layer of each kind of the hybrid pattern "M-*E", an instance of its
    real class (NemotronHModel.forward refuses any other) whose boundary's
    capture_output is the real StageBoundary's."""
    cls = _NEMOTRON_H_LAYERS[layer_id]
    layer = type(cls.__name__, (_Layer, cls), {})(layer_id)
    layer.boundary = StageBoundary.__new__(StageBoundary)
    return layer


class _Identity(nn.Module):
    def forward(self, hidden_states):
        return hidden_states


class _Mixer(nn.Module):
    """An attention or short-conv mixer whose output is ``value`` everywhere."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, *args):
        hidden_states = args[1] if len(args) == 3 else args[0]
        return torch.full_like(hidden_states, self.value)


class _NoFFN(nn.Module):
    def forward(self, hidden_states):
        return torch.zeros_like(hidden_states)


def _lfm2_layer(layer_cls, layer_id):
    """LFM2's real decoder layer (it takes the capture itself, without the
    residual stream): attention and short-conv layers alternate, each adding
    ``layer_id + 1``."""
    layer = layer_cls.__new__(layer_cls)
    nn.Module.__init__(layer)
    layer.is_attention_layer = layer_id % 2 == 1
    layer._is_layer_to_capture = False
    layer.operator_norm = _Identity()
    layer.ffn_norm = _Identity()
    mixer = _Mixer(float(layer_id + 1))
    if layer.is_attention_layer:
        layer.self_attn = mixer
    else:
        layer.conv = mixer
    layer.feed_forward = _NoFFN()
    return layer


# ---------------------------------------------------------------------------
# The models, and the classes the model runner holds around them.
# ---------------------------------------------------------------------------


def _model(cls, layer=_Layer, norm="norm", **attrs):
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([layer(i) for i in range(NUM_LAYERS)])
    setattr(model, norm, InPlaceNorm())
    model.layers_to_capture = []
    model.pp_group = _stage()
    for name, value in attrs.items():
        setattr(model, name, value)
    return model


def _qwen3_5(cls):
    # start_layer and end_layer are properties over _start_layer and _end_layer.
    return _model(
        cls,
        _start_layer=0,
        _end_layer=NUM_LAYERS,
        hidden_size=HIDDEN,
        flashinfer_mnnvl_cutedsl_fusion=None,
        meta_mlp=nn.ModuleList(),
    )


def _with_stage(cls, **attrs):
    return _model(cls, start_layer=0, end_layer=NUM_LAYERS, **attrs)


def _bailing(start_layer=0, end_layer=NUM_LAYERS):
    return _model(
        BailingMoELinearModel,
        start_layer=start_layer,
        end_layer=end_layer,
        pp_group=_stage(start_layer, end_layer),
        layers_to_capture=None,
        capture_aux_hidden_states=False,
    )


def _wrap(model, chain):
    """``model`` inside each (class, attribute) of ``chain``, innermost first;
    returns the outermost, the one the model runner holds."""
    inner = model
    for cls, attr in chain:
        outer = cls.__new__(cls)
        if isinstance(outer, nn.Module):
            nn.Module.__init__(outer)
            config = types.SimpleNamespace(
                hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS
            )
            outer.config = types.SimpleNamespace(text_config=config, **vars(config))
            outer.pp_group = getattr(model, "pp_group", _stage())
            if not hasattr(cls, "capture_aux_hidden_states"):
                # (A class that derives the flag from its model defines it.)
                outer.capture_aux_hidden_states = False
        setattr(outer, attr, inner)
        inner = outer
    return inner


@dataclass(frozen=True)
class _Spec:
    build: Callable[[], nn.Module]
    # The forward's keyword for the input embeddings.
    embeds: str
    # Chains from the model out to each class the model runner may hold around
    # it (each reports the width); the first one takes the forward tests'
    # captures through its setter.
    holders: tuple
    setter: str = "set_dflash_layers_to_capture"
    # An idle batch returns an empty [0, K * H] buffer (True) or the hidden
    # states alone (False).
    idle_packs: Optional[bool] = None

    @property
    def name(self):
        return type(self.build()).__name__


SPECS = (
    _Spec(
        lambda: _model(Qwen3NextModel),
        "inputs_embeds",
        (((Qwen3NextForCausalLM, "model"),),),
        idle_packs=True,
    ),
    _Spec(
        lambda: _qwen3_5(Qwen3_5ForCausalLM),
        "input_embeds",
        (
            ((qwen3_5_text.Qwen3_5ForCausalLM, "model"),),
            # MiniCPM-V 4.6's version dispatcher forwards attribute reads to the
            # 4.6 model around a Qwen3.5 body.
            ((MiniCPMV4_6, "llm"), (MiniCPMV4_6ForConditionalGeneration, "minicpmv")),
        ),
        idle_packs=True,
    ),
    _Spec(
        lambda: _qwen3_5(Qwen3_5MoeForCausalLM),
        "input_embeds",
        (((qwen3_5_text.Qwen3_5MoeForCausalLM, "model"),),),
        idle_packs=True,
    ),
    # InternS2MobiusForConditionalGeneration reports its width as the Qwen3-VL
    # wrapper it subclasses, which the Qwen3-VL tests cover: the body's own
    # setter takes the captures here.
    _Spec(
        lambda: _qwen3_5(InternS2MobiusForCausalLM),
        "input_embeds",
        (),
        idle_packs=True,
    ),
    _Spec(
        lambda: _with_stage(GraniteMoeHybridModel),
        "inputs_embeds",
        (((GraniteMoeHybridForCausalLM, "model"),),),
    ),
    _Spec(
        lambda: _with_stage(
            Glm5NextModel,
            layer=_Glm5NextLayer,
            first_k_dense_replace=0,
            enable_a2a_moe=False,
            dflash_capture=False,
            config=types.SimpleNamespace(mhc=False, hc_mult=HC_MULT),
        ),
        "input_embeds",
        (((Glm5NextForConditionalGeneration, "model"),),),
        idle_packs=True,
    ),
    _Spec(
        lambda: _with_stage(MiniMaxM3Model, finalize_norm=None),
        "input_embeds",
        (
            ((MiniMaxM3SparseForCausalLM, "model"),),
            ((MiniMaxM3SparseForConditionalGeneration, "model"),),
        ),
        setter="set_eagle3_layers_to_capture",
    ),
    _Spec(
        lambda: _model(
            Lfm2Model,
            layer=lambda i: _lfm2_layer(Lfm2DecoderLayer, i),
            norm="embedding_norm",
        ),
        "input_embeds",
        (
            ((Lfm2ForCausalLM, "model"),),
            # LFM2-VL's language model is an Lfm2ForCausalLM.
            (
                (Lfm2ForCausalLM, "model"),
                (Lfm2VlForConditionalGeneration, "language_model"),
            ),
        ),
        idle_packs=False,
    ),
    _Spec(
        lambda: _model(
            Lfm2MoeModel,
            layer=lambda i: _lfm2_layer(Lfm2MoeDecoderLayer, i),
            norm="embedding_norm",
        ),
        "inputs_embeds",
        (((Lfm2MoeForCausalLM, "model"),),),
        idle_packs=False,
    ),
    _Spec(
        lambda: _with_stage(NemotronHModel, layer=_nemotron_h_layer, norm="norm_f"),
        "inputs_embeds",
        (
            ((NemotronHForCausalLM, "model"),),
            (
                (NemotronHForCausalLM, "model"),
                (NemotronH_Nano_VL_V2, "language_model"),
            ),
        ),
    ),
    _Spec(
        lambda: _with_stage(
            KimiLinearModel,
            dspark_layers_to_capture=None,
            config=types.SimpleNamespace(hidden_size=HIDDEN),
        ),
        "inputs_embeds",
        (((KimiLinearForCausalLM, "model"),),),
        setter="set_dspark_layers_to_capture",
    ),
    _Spec(
        _bailing,
        "input_embeds",
        (((BailingMoeV3ForCausalLM, "model"),),),
        setter="set_dspark_layers_to_capture",
        idle_packs=False,
    ),
)


def _spec(model_cls):
    return next(spec for spec in SPECS if spec.name == model_cls.__name__)


def _capturing(spec, layer_ids, model=None):
    """The model as the setter the model runner calls leaves it, capturing the
    outputs of ``layer_ids``."""
    model = spec.build() if model is None else model
    if spec.holders:
        getattr(_wrap(model, spec.holders[0]), spec.setter)(list(layer_ids))
    else:
        # The body's own setter takes capture indices: index i is the input of
        # layer i, the output of layer i - 1.
        model.set_dflash_layers_to_capture([k + 1 for k in layer_ids])
    return model


def _run(spec, model, embeds, buffer=None, mode=ForwardMode.EXTEND, **kwargs):
    batch = forward_batch(mode, buffer, capture_hidden_mode=CaptureHiddenMode.FULL)
    with get_parallel().override(pp_group=getattr(model, "pp_group", _stage())):
        return model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=batch,
            **{spec.embeds: embeds},
            **kwargs,
        )


class TestHybridStacksAuxPacker(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # The last id is the last layer's output (pre_norm: the stream entering
        # the final norm, kept apart from the norm's in-place update).
        layer_ids = [0, 2, NUM_LAYERS - 1]
        for spec in SPECS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                hidden, aux = _run(spec, _capturing(spec, layer_ids), embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
                torch.testing.assert_close(aux, _expected(embeds, layer_ids))
                torch.testing.assert_close(
                    hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5
                )
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_post_norm_last_capture_is_the_final_norm_output(self):
        # The draft's choice of the last layer's capture (--speculative-final-
        # layer-capture): post_norm takes the final norm's output, copied into
        # its slot.
        layer_ids = [1, NUM_LAYERS - 1]
        for spec in SPECS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                model = _capturing(spec, layer_ids)
                set_final_layer_capture(model, "post_norm")
                hidden, aux = _run(spec, model, embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                torch.testing.assert_close(
                    hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5
                )
                torch.testing.assert_close(
                    aux, torch.cat([stream_after(embeds, 1), hidden], dim=-1)
                )
                self.assertNotEqual(
                    aux.untyped_storage().data_ptr(),
                    hidden.untyped_storage().data_ptr(),
                )

    def test_decode_graph_buffer_is_filled_in_place(self):
        layer_ids = [1, NUM_LAYERS - 1]
        for spec in SPECS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
                model = _capturing(spec, layer_ids)
                _, aux = _run(spec, model, embeds.clone(), shared[:TOKENS])
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                torch.testing.assert_close(
                    shared[:TOKENS], _expected(embeds, layer_ids)
                )
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        for spec in SPECS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                out = _run(spec, spec.build(), embeds.clone())
                self.assertIsInstance(out, torch.Tensor)
                torch.testing.assert_close(
                    out, stream_after(embeds, NUM_LAYERS - 1) * 0.5
                )

    def test_idle_batch(self):
        # Models that take the last layer's capture as a snapshot on an idle
        # batch return an empty packed buffer; those whose layers skip an idle
        # batch take no capture at all (DFlash skips idle batches).
        layer_ids = [0, NUM_LAYERS - 1]
        for spec in SPECS:
            if spec.idle_packs is None:
                continue
            with self.subTest(model=spec.name):
                model = _capturing(spec, layer_ids)
                out = _run(spec, model, torch.empty(0, HIDDEN), mode=ForwardMode.IDLE)
                if spec.idle_packs:
                    _, aux = out
                    self.assertIsInstance(aux, torch.Tensor)
                    self.assertEqual(tuple(aux.shape), (0, len(layer_ids) * HIDDEN))
                else:
                    self.assertIsInstance(out, torch.Tensor)
                    self.assertEqual(tuple(out.shape), (0, HIDDEN))

    def test_runner_model_reports_the_packed_width(self):
        layer_ids = [0, 2, NUM_LAYERS - 1]
        for spec in SPECS:
            for chain in spec.holders:
                outer = _wrap(spec.build(), chain)
                with self.subTest(model=spec.name, holder=type(outer).__name__):
                    self.assertEqual(outer.get_aux_hidden_states_width(), 0)
                    getattr(outer, spec.setter)(layer_ids)
                    self.assertEqual(
                        outer.get_aux_hidden_states_width(),
                        len(layer_ids) * HIDDEN,
                    )

    def test_glm5_next_dflash_mhc_captures_are_contracted_into_their_slots(self):
        # Under DFlash an mHC model's layer-input capture is the hc_mult streams
        # contracted to hidden_size (their mean), packed K * hidden wide.
        spec = _spec(Glm5NextModel)
        layer_ids = [0, 1]
        model = spec.build()
        model.config.mhc = True
        _capturing(spec, layer_ids, model)
        streams = torch.randn(TOKENS, HC_MULT * HIDDEN)
        _, aux = _run(spec, model, streams.clone())
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        expected = torch.cat(
            [
                stream_after(streams, k).unflatten(-1, (HC_MULT, HIDDEN)).mean(dim=-2)
                for k in layer_ids
            ],
            dim=-1,
        )
        torch.testing.assert_close(aux, expected)

    def test_bailing_last_pipeline_stage_packs_the_ids_of_its_layers(self):
        # Only the last stage captures: the ids of its layers (2 and 3), not
        # those of the earlier stage's; the first stage reports no width.
        spec = _spec(BailingMoELinearModel)
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        received = PPProxyTensors({"hidden_states": stream_after(embeds, 1)})
        model = _capturing(spec, layer_ids, _bailing(start_layer=2))
        _, aux = _run(spec, model, torch.empty(0, HIDDEN), pp_proxy_tensors=received)
        torch.testing.assert_close(aux, _expected(embeds, [2, NUM_LAYERS - 1]))
        for stage, width in (({"end_layer": 2}, 0), ({"start_layer": 2}, 2 * HIDDEN)):
            with self.subTest(stage=stage):
                lm = _wrap(_bailing(**stage), spec.holders[0])
                lm.set_dspark_layers_to_capture(layer_ids)
                self.assertEqual(lm.get_aux_hidden_states_width(), width)

    def test_bailing_batch_without_rows_takes_no_captures(self):
        # Every capture of one forward is the stream on the same rows: a batch
        # without rows takes none of the K, and an idle batch (which skips the
        # final norm, so could not take the last layer's) takes none either.
        spec = _spec(BailingMoELinearModel)
        layer_ids = [0, NUM_LAYERS - 1]
        for mode, rows in ((ForwardMode.EXTEND, 0), (ForwardMode.IDLE, TOKENS)):
            with self.subTest(mode=mode.name, rows=rows):
                model = _capturing(spec, layer_ids)
                out = _run(spec, model, torch.randn(rows, HIDDEN), mode=mode)
                self.assertIsInstance(out, torch.Tensor)
                self.assertEqual(tuple(out.shape), (rows, HIDDEN))

    def test_nemotron_h_mtp_draft_reports_no_width(self):
        # The MTP draft subclass holds a NemotronHMultiTokenPredictor and never
        # captures (nor sets capture_aux_hidden_states).
        mtp = NemotronHForCausalLMMTP.__new__(NemotronHForCausalLMMTP)
        nn.Module.__init__(mtp)
        mtp.model = nn.Module()
        self.assertEqual(mtp.get_aux_hidden_states_width(), 0)

    def test_qwen4_exp_reports_no_width(self):
        # Its forward returns the captures only on an idle batch (its decoder
        # layers write none): no decode graph buffer for it to leave unfilled,
        # whether its setter takes the ids or refuses them.
        holder = _wrap(
            _qwen3_5(Qwen4ExpVLModel), ((Qwen4ExpForConditionalGeneration, "model"),)
        )
        with contextlib.suppress(ValueError):
            holder.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
        self.assertEqual(
            resolve_aux_hidden_states_width(
                model=holder, spec_algorithm=DFLASH, is_draft_worker=False
            ),
            0,
        )


if __name__ == "__main__":
    unittest.main()
