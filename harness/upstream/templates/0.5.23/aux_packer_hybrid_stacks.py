# upstream-path: test/registered/unit/models/test_aux_packer_hybrid_stacks.py
"""The hybrid and linear-attention stacks pack their EAGLE3 / DFlash / DSpark aux
hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). Qwen3NextModel, the Qwen3.5
bodies (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, InternS2MobiusForCausalLM),
GraniteMoeHybridModel, Glm5NextModel, MiniMaxM3Model, Lfm2Model, Lfm2MoeModel,
NemotronHModel, KimiLinearModel and BailingMoELinearModel collect into
AuxHiddenStatePacker instead: each capture, the last layer's included, is
copied once into its slot of one [T, K * H]
buffer, which is what the forward returns and what pack_aux_hidden_states
hands on unchanged. A DFlash-family decode CUDA graph passes a slice of one
shared buffer on the batch (aux_hidden_states_buffer), sized by the
get_aux_hidden_states_width of the class the model runner holds (the CausalLM,
or a multimodal wrapper around it).

KimiK3LinearModel and KimiLinearModel packed them without pipeline parallelism
only; with PP > 1 each stage collected a list, a stage that is not the last
concatenated its own into ``pp_proxy_tensors["dspark_hidden_states"]``, and the
last one concatenated the received block with its own captures. Now every stage
packs: a later stage copies the received block (K' captures side by side) into
its first K' slots, then its own captures; a stage that is not the last sends
its packed buffer on as it is. Capture ids are layer outputs: on the standard
residual path layer i's input captures the output of layer i - 1 (a stage's
first layer the previous stage's last one) and the final norm the last layer's;
on kimi_k3's attention-residual bank path the mixture after layer i is
captured, the previous stage's last one at the stage's start. A DFlash-family
decode graph's buffer is filled in place on every stage, and each stage's
CausalLM reports the width of what it sends on or returns.

TestHybridStacksAuxPacker runs over every model of the table below: the
captures are enabled through the real setters with draft layer ids (id k is the
output of layer k), and the expected values follow from the stand-in layers'
arithmetic. Runs on CPU without a GPU or a checkpoint: the decoder layers
(LFM2's mixers), the final norms and kimi_k3's bank are small stand-ins on the
real residual stream (``forward_batch.residual_stream``), the bank's mixture a
snapshot of the stream; each model's forward, each CausalLM and wrapper, and
their setters are the real ones, the Kimi models' run stage by stage with the
pipeline group overridden.
"""

import contextlib
import types
import unittest
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
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
from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM, KimiK3LinearModel
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

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
HC_MULT = 2
SPLIT = 2  # a two-stage pipeline: the first takes layers 0 and 1, the last 2 and 3
DFLASH = types.SimpleNamespace(is_dflash_family=lambda: True)


def _expected(embeds, layer_ids):
    # The outputs of these layers: capture indices k + 1.
    return expected_captures(embeds, [k + 1 for k in layer_ids])


def _stage(start_layer=0, end_layer=NUM_LAYERS):
    whole = start_layer == 0 and end_layer == NUM_LAYERS
    return types.SimpleNamespace(
        is_first_rank=start_layer == 0,
        is_last_rank=end_layer == NUM_LAYERS,
        world_size=1 if whole else 2,
    )


# ---------------------------------------------------------------------------
# Stand-ins: decoder layers and final norms on the real residual stream.
# ---------------------------------------------------------------------------


class _FromPP:
    """A pipeline stage's entry: a fresh stream holding the received output."""

    def from_pp(self, pp_proxy_tensors, forward_batch):
        residual_batch.start(forward_batch)
        return pp_proxy_tensors["hidden_states"] + pp_proxy_tensors.tensors.get(
            "residual", 0
        )


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


def _kimi_linear(layer_ids=None, start_layer=0, end_layer=NUM_LAYERS):
    return _model(
        KimiLinearModel,
        start_layer=start_layer,
        end_layer=end_layer,
        pp_group=_stage(start_layer, end_layer),
        dspark_layers_to_capture=None if layer_ids is None else list(layer_ids),
        config=types.SimpleNamespace(hidden_size=HIDDEN),
    )


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
        _kimi_linear,
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


# ---------------------------------------------------------------------------
# Kimi's pipeline stages: each real forward run as one stage of two, the first
# stage's PPProxyTensors handed to the last.
# ---------------------------------------------------------------------------


class _KimiK3Layer(_Layer):
    """kimi_k3 hands its collector as ``capture_gathered``, as its attention
    boundary takes it."""

    def forward(self, positions, hidden_states, forward_batch, *args, **kwargs):
        gathered = kwargs.pop("capture_gathered", None)
        if gathered is not None:
            kwargs["captured_last_layer_outputs"] = gathered
        return super().forward(positions, hidden_states, forward_batch, **kwargs)


class _Bank:
    """The attention-residual bank's lifecycle, holding one row block per token."""

    def open(self, hidden_states, num_blocks, inherited):
        self.block_residual = (
            hidden_states.new_zeros(hidden_states.shape[0], num_blocks, HIDDEN)
            if inherited is None
            else inherited
        )

    def require(self):
        return self

    def close(self):
        pass


def _kimi_k3(layer_ids=None, start_layer=0, end_layer=NUM_LAYERS, bank=False):
    model = _model(
        KimiK3LinearModel,
        layer=_KimiK3Layer,
        norm="_final_read",
        start_layer=start_layer,
        end_layer=end_layer,
        pp_group=_stage(start_layer, end_layer),
        dspark_layers_to_capture=None if layer_ids is None else list(layer_ids),
        carries_bank_slices=False,
        attn_bank=_Bank() if bank else None,
        config=types.SimpleNamespace(hidden_size=HIDDEN, attn_res_block_size=2),
    )
    if bank:
        # The bank's capture is the mixture the next read would form; here the
        # stream itself, so both paths capture the same values.
        model._dspark_capture_stream = lambda layer_id, hidden, batch: (
            residual_batch.snapshot(hidden, batch)
        )
    return model


def _run_stage(model, embeds, buffer=None, pp_proxy_tensors=None):
    """One stage's real forward; both Kimi models take ``inputs_embeds``, as
    KimiLinearModel's spec says."""
    spec = _spec(KimiLinearModel)
    return _run(spec, model, embeds, buffer, pp_proxy_tensors=pp_proxy_tensors)


def _two_stages(layer_ids, embeds, bank=False, buffers=(None, None), model=None):
    """(what the first stage sends, what the last returns), each stage the real
    forward of its own model."""
    model = model or (lambda ids, **stage: _kimi_k3(ids, bank=bank, **stage))
    proxy = _run_stage(model(layer_ids, end_layer=SPLIT), embeds.clone(), buffers[0])
    out = _run_stage(
        model(layer_ids, start_layer=SPLIT),
        torch.empty(0, HIDDEN),
        buffers[1],
        pp_proxy_tensors=PPProxyTensors(dict(proxy.tensors)),
    )
    return proxy, out


class TestKimiK3PipelineStagesPack(CustomTestCase):
    def _check_packed(self, hidden, aux, embeds, layer_ids):
        # One [T, K * H] tensor holding the captures in order, the final norm's
        # output beside it, and the logits processor hands it on as it is.
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        torch.testing.assert_close(aux, _expected(embeds, layer_ids))
        torch.testing.assert_close(hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5)
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_single_stage_returns_one_packed_buffer(self):
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        for bank in (False, True):
            hidden, aux = _run_stage(_kimi_k3(layer_ids, bank=bank), embeds.clone())
            self._check_packed(hidden, aux, embeds, layer_ids)

    def test_pipeline_stages_carry_their_captures_in_slots(self):
        # The first stage packs id 0 (its last layer's output, id 1, is the
        # stream the last stage receives and captures first); the last stage
        # puts the received block in its first slot, then ids 1 and 3.
        layer_ids = [0, 1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        for bank in (False, True):
            proxy, (hidden, aux) = _two_stages(layer_ids, embeds, bank=bank)
            sent = proxy["dspark_hidden_states"]
            torch.testing.assert_close(sent, _expected(embeds, [0]))
            self._check_packed(hidden, aux, embeds, layer_ids)

    def test_decode_graph_buffers_are_filled_in_place_on_each_stage(self):
        # The first stage sends its graph buffer itself; the last stage's
        # buffer holds every capture, the received ones first.
        layer_ids = [0, 1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        first = torch.full((TOKENS + 3, HIDDEN), float("nan"))
        last = torch.full((TOKENS + 3, 3 * HIDDEN), float("nan"))
        proxy, (_, aux) = _two_stages(
            layer_ids, embeds, buffers=(first[:TOKENS], last[:TOKENS])
        )
        sent = proxy["dspark_hidden_states"]
        self.assertEqual(
            sent.untyped_storage().data_ptr(), first.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(first[:TOKENS], _expected(embeds, [0]))
        self.assertEqual(
            aux.untyped_storage().data_ptr(), last.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(last[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(first[TOKENS:]).all())
        self.assertTrue(torch.isnan(last[TOKENS:]).all())

    def test_no_capture_returns_hidden_states_alone(self):
        embeds = torch.randn(TOKENS, HIDDEN)
        self.assertIsInstance(_run_stage(_kimi_k3(), embeds.clone()), torch.Tensor)
        proxy, out = _two_stages(None, embeds)
        self.assertNotIn("dspark_hidden_states", proxy.tensors)
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width_per_stage(self):
        def causal_lm(**stage):
            lm = KimiK3LinearForCausalLM.__new__(KimiK3LinearForCausalLM)
            nn.Module.__init__(lm)
            lm.model = _kimi_k3(**stage)
            lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
            lm.capture_aux_hidden_states = False
            return lm

        layer_ids = [0, 1, NUM_LAYERS - 1]
        for stage, width in (
            ({}, 3 * HIDDEN),
            # What the first stage sends on: ids before its last layer.
            ({"end_layer": SPLIT}, HIDDEN),
            # What the last stage returns: every id, the received ones included.
            ({"start_layer": SPLIT}, 3 * HIDDEN),
        ):
            lm = causal_lm(**stage)
            self.assertEqual(lm.get_aux_hidden_states_width(), 0)
            lm.set_dspark_layers_to_capture(layer_ids)
            self.assertEqual(lm.get_aux_hidden_states_width(), width, stage)


class TestKimiLinearPipelineStagesPack(CustomTestCase):
    def test_stages_send_and_return_one_packed_buffer(self):
        # The first stage (layers 0, 1) packs ids 0 and 1; the last puts them in
        # its first two slots and its own id 3 after them.
        layer_ids = [0, 1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        proxy, (hidden, aux) = _two_stages(layer_ids, embeds, model=_kimi_linear)
        torch.testing.assert_close(
            proxy["dspark_hidden_states"], _expected(embeds, [0, 1])
        )
        self.assertIsInstance(aux, torch.Tensor)
        torch.testing.assert_close(aux, _expected(embeds, layer_ids))
        torch.testing.assert_close(hidden, stream_after(embeds, NUM_LAYERS - 1) * 0.5)

    def test_decode_graph_buffers_are_filled_in_place_on_each_stage(self):
        layer_ids = [0, 1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        first = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
        last = torch.full((TOKENS + 3, 3 * HIDDEN), float("nan"))
        proxy, (_, aux) = _two_stages(
            layer_ids,
            embeds,
            buffers=(first[:TOKENS], last[:TOKENS]),
            model=_kimi_linear,
        )
        self.assertEqual(
            proxy["dspark_hidden_states"].untyped_storage().data_ptr(),
            first.untyped_storage().data_ptr(),
        )
        self.assertEqual(
            aux.untyped_storage().data_ptr(), last.untyped_storage().data_ptr()
        )
        torch.testing.assert_close(last[:TOKENS], _expected(embeds, layer_ids))
        self.assertTrue(torch.isnan(first[TOKENS:]).all())
        self.assertTrue(torch.isnan(last[TOKENS:]).all())

    def test_causal_lm_reports_the_packed_width_per_stage(self):
        layer_ids = [0, 1, NUM_LAYERS - 1]
        for stage, width in (
            ({"end_layer": SPLIT}, 2 * HIDDEN),
            ({"start_layer": SPLIT}, 3 * HIDDEN),
        ):
            lm = KimiLinearForCausalLM.__new__(KimiLinearForCausalLM)
            nn.Module.__init__(lm)
            lm.model = _kimi_linear(layer_ids, **stage)
            lm.config = types.SimpleNamespace(hidden_size=HIDDEN)
            lm.capture_aux_hidden_states = True
            self.assertEqual(lm.get_aux_hidden_states_width(), width, stage)


if __name__ == "__main__":
    unittest.main()
