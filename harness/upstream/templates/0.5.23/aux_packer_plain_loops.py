# upstream-path: test/registered/unit/models/test_aux_packer_plain_loops.py
"""Models that capture in one plain loop over their layers pack their EAGLE3/DFlash
aux hidden states into one buffer.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). The models below take capture
index i at the input of layer i in one loop over their layers, and index
num_layers (the last layer's output) after it, at the final norm. They now
collect into AuxHiddenStatePacker: each capture is copied once into its slot of
one [T, K * H] buffer, which is what the forward returns and what
pack_aux_hidden_states hands on unchanged. A DFlash decode CUDA graph passes a
slice of one shared buffer on the batch (aux_hidden_states_buffer), sized by
get_aux_hidden_states_width on each CausalLM and on the multimodal wrappers that
run them. Qwen3-VL's language models (Qwen3LLMModel, Qwen3MoeLLMModel:
Qwen3Model and Qwen3MoeModel subclasses) run the same loop with deepstack
embeddings joining the stream after the first layers; their wrappers are the
CausalLMs.

DeepseekV2Model and MiMoV2Model already packed, but sized their packer with
``len(layers_to_capture)`` and ignored a DFlash decode graph's shared buffer,
and their CausalLMs (and Kimi-K2.5's wrapper) reported no width: each graph
size kept a packed output of its own. They now count their captures, fill
the batch's slice in place and report K * hidden.

The tests of TestAuxPackerPlainLoops run over the table MODELS, one subTest per
model; the Qwen3-VL and DeepSeek / MiMo tests over tables of their own. Runs on
CPU without a GPU or a checkpoint: decoder layers and norms are small stand-ins
(on the real residual stream where the model uses one; with Gemma3's and Muse
Glimmer's own layouts otherwise), the final norm updates its input in place
like the fused GPU kernel, and each model's forward and each CausalLM's
setters are the real ones. Layer k adds k + 1 to the stream, so the stream
entering layer i is the embedding plus 1 + ... + i.
"""

import dataclasses
import types
import unittest
from typing import Optional
from unittest import mock

import torch
from torch import nn

from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner_components.misc_utils import (
    resolve_aux_hidden_states_width,
)
from sglang.srt.models import exaone_moe, kimi_k25, minimax_m2
from sglang.srt.models.apertus import ApertusForCausalLM, ApertusModel
from sglang.srt.models.arcee import ArceeForCausalLM, ArceeModel
from sglang.srt.models.bailing_moe import (
    BailingMoEForCausalLM,
    BailingMoEModel,
    BailingMoeForCausalLM,
    BailingMoeV2ForCausalLM,
)
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Model
from sglang.srt.models.exaone_moe import (
    ExaoneMoEForCausalLM,
    ExaoneMoEModel,
    ExaoneMoeForCausalLM,
)
from sglang.srt.models.exaone_moe_mtp import ExaoneMoEForCausalLMMTP
from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM, Gemma3TextModel
from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration
from sglang.srt.models.gemma4_causal import Gemma4ForCausalLM, Gemma4TextModel
from sglang.srt.models.gemma4_mm import Gemma4ForConditionalGeneration
from sglang.srt.models.glm4 import Glm4ForCausalLM, Glm4Model
from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeModel
from sglang.srt.models.glm4_moe_lite import Glm4MoeLiteForCausalLM, Glm4MoeLiteModel
from sglang.srt.models.gpt_oss import GptOssForCausalLM, GptOssModel
from sglang.srt.models.laguna import LagunaForCausalLM, LagunaModel
from sglang.srt.models.llama import LlamaForCausalLM, LlamaModel
from sglang.srt.models.llama4 import Llama4ForCausalLM, Llama4Model
from sglang.srt.models.longcat_flash import LongcatFlashForCausalLM, LongcatFlashModel
from sglang.srt.models.longcat_flash_nextn import LongcatFlashForCausalLMNextN
from sglang.srt.models.mimo_v2 import MiMoV2ForCausalLM, MiMoV2Model
from sglang.srt.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2Model
from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration
from sglang.srt.models.muse_glimmer import (
    MuseGlimmerForCausalLM,
    MuseGlimmerForConditionalGeneration,
    MuseGlimmerModel,
)
from sglang.srt.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeModel
from sglang.srt.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeModel
from sglang.srt.models.qwen3_vl import Qwen3LLMModel, Qwen3VLForConditionalGeneration
from sglang.srt.models.qwen3_vl_moe import (
    Qwen3MoeLLMModel,
    Qwen3VLMoeForConditionalGeneration,
)
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
CONFIG = types.SimpleNamespace(hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS)
ONLY_RANK = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)


# ---------------------------------------------------------------------------
# Stand-ins. Layer k adds k + 1 to the stream; every final norm halves it.
# ---------------------------------------------------------------------------


class _TopKLayer(StreamLayer):
    """LongcatFlashDecoderLayer and DeepseekV2DecoderLayer also return their
    top-k indices."""

    def __init__(self, layer_id):
        super().__init__(layer_id, returns_topk=True)


class _WholeStreamLayer(StreamLayer):
    """Gemma4DecoderLayer writes the whole next stream at its exit."""

    def finish(self, hidden_states, forward_batch):
        hidden_states = hidden_states + float(self.layer_id + 1)
        residual_batch.set_written(hidden_states, forward_batch)
        return hidden_states


class _Gemma3Layer(nn.Module):
    """Gemma3DecoderLayer's residual layout: the first layer adopts its input as
    the residual (unfused norm, fresh storage), the others add their input into
    it in place with the fused input norm; it returns its FFN output
    (``layer_id + 1``) and the residual apart."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = InPlaceNorm()

    def forward(self, positions, hidden_states, forward_batch, residual=None, **kw):
        if residual is None:
            residual, hidden_states = hidden_states, hidden_states * 0.5
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return torch.full_like(hidden_states, float(self.layer_id + 1)), residual


class _MuseGlimmerLayer(nn.Module):
    """MuseGlimmerDecoderLayer's interface: takes the stream and returns the
    next one (its residual adds are inside)."""

    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch):
        return hidden_states + float(self.layer_id + 1)


# ---------------------------------------------------------------------------
# The group: each model, the CausalLMs over it, and what its forward reads.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_cls: type
    lm_classes: tuple  # CausalLMs whose ``model`` is a model_cls
    layer_cls: type = StreamLayer
    attrs: dict = dataclasses.field(default_factory=dict)  # more the forward reads
    idle: bool = False  # has an idle-batch path (the last capture a snapshot)
    pipeline: bool = True  # counts its captures per PP stage (start/end_layer)
    dflash_ids: tuple = (0, 2, NUM_LAYERS - 1)  # three captures
    wrapper: Optional[type] = None  # a multimodal class whose forward runs it
    wrapper_holds_text_model: bool = False  # else it holds lm_classes[0]

    @property
    def name(self):
        return self.model_cls.__name__


_GLM4 = dict(first_k_dense_replace=0)
_MOE = dict(use_ngram_embedding=False)

MODELS = (
    ModelSpec(LlamaModel, (LlamaForCausalLM,)),
    ModelSpec(Qwen2Model, (Qwen2ForCausalLM,)),
    ModelSpec(Qwen3Model, (Qwen3ForCausalLM,)),
    ModelSpec(Qwen2MoeModel, (Qwen2MoeForCausalLM,)),
    ModelSpec(Qwen3MoeModel, (Qwen3MoeForCausalLM,)),
    ModelSpec(GptOssModel, (GptOssForCausalLM,), idle=True),
    ModelSpec(Glm4Model, (Glm4ForCausalLM,), attrs=_GLM4, idle=True),
    ModelSpec(Glm4MoeModel, (Glm4MoeForCausalLM,), attrs=_GLM4, idle=True),
    ModelSpec(Glm4MoeLiteModel, (Glm4MoeLiteForCausalLM,), attrs=_GLM4, idle=True),
    ModelSpec(MiniMaxM2Model, (MiniMaxM2ForCausalLM,), idle=True),
    ModelSpec(ApertusModel, (ApertusForCausalLM,)),
    ModelSpec(ArceeModel, (ArceeForCausalLM,)),
    ModelSpec(
        Llama4Model,
        (Llama4ForCausalLM,),
        idle=True,
        pipeline=False,
        wrapper=Llama4ForConditionalGeneration,
    ),
    ModelSpec(
        ExaoneMoEModel,
        (ExaoneMoEForCausalLM, ExaoneMoeForCausalLM),
        attrs=_MOE,
        idle=True,
    ),
    ModelSpec(
        LongcatFlashModel,
        (LongcatFlashForCausalLM,),
        layer_cls=_TopKLayer,
        attrs=_MOE,
        idle=True,
        pipeline=False,
    ),
    ModelSpec(
        BailingMoEModel,
        (BailingMoEForCausalLM, BailingMoeForCausalLM, BailingMoeV2ForCausalLM),
        attrs=_MOE,
        idle=True,
    ),
    ModelSpec(
        Gemma4TextModel,
        (Gemma4ForCausalLM,),
        layer_cls=_WholeStreamLayer,
        # no per-layer embeddings
        attrs=dict(config=CONFIG, per_layer_model_projection=None),
        wrapper=Gemma4ForConditionalGeneration,
        wrapper_holds_text_model=True,
    ),
    ModelSpec(LagunaModel, (LagunaForCausalLM,)),
    ModelSpec(
        Gemma3TextModel,
        (Gemma3ForCausalLM,),
        layer_cls=_Gemma3Layer,
        attrs=dict(
            rotary_emb=lambda hidden_states, positions: None,
            rotary_emb_local=lambda hidden_states, positions: None,
        ),
        pipeline=False,
        wrapper=Gemma3ForConditionalGeneration,
    ),
    ModelSpec(
        MuseGlimmerModel,
        (MuseGlimmerForCausalLM, MuseGlimmerForConditionalGeneration),
        layer_cls=_MuseGlimmerLayer,
        attrs=dict(embed_norm=None),
        pipeline=False,
        # Its DFlash ids are capture indices: num_layers is the last layer's output.
        dflash_ids=(0, 2, NUM_LAYERS),
    ),
)


def _spec(model_cls):
    return next(spec for spec in MODELS if spec.model_cls is model_cls)


def _new(cls, **attrs):
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def _model(spec, layers_to_capture=()):
    return _new(
        spec.model_cls,
        layers=nn.ModuleList([spec.layer_cls(i) for i in range(NUM_LAYERS)]),
        start_layer=0,
        end_layer=NUM_LAYERS,
        layers_to_capture=list(layers_to_capture),
        norm=InPlaceNorm(),
        pp_group=ONLY_RANK,
        **spec.attrs,
    )


def _causal_lm(spec, lm_cls):
    return _new(
        lm_cls,
        model=_model(spec),
        config=CONFIG,
        pp_group=ONLY_RANK,
        capture_aux_hidden_states=False,
    )


def _wrapper(spec):
    if spec.wrapper_holds_text_model:
        return _new(
            spec.wrapper,
            language_model=_model(spec),
            config=types.SimpleNamespace(text_config=CONFIG),
            capture_aux_hidden_states=False,
        )
    return _new(spec.wrapper, language_model=_causal_lm(spec, spec.lm_classes[0]))


def _width_reporters(spec):
    """(class, build) for each class that reports the packed width over spec's
    model: its CausalLMs and the multimodal wrapper a checkpoint may load as."""
    for lm_cls in spec.lm_classes:
        yield lm_cls, lambda lm_cls=lm_cls: _causal_lm(spec, lm_cls)
    if spec.wrapper is not None:
        yield spec.wrapper, lambda: _wrapper(spec)


def _run(model, embeds, buffer=None, forward_mode=ForwardMode.EXTEND, **extra):
    return model.forward(
        input_ids=None,
        positions=torch.arange(embeds.shape[0]),
        forward_batch=forward_batch(forward_mode, buffer),
        input_embeds=embeds,
        **extra,
    )


def _stream(embeds, i):
    """The stream entering layer i (i = num_layers: the last layer's output)."""
    return stream_after(embeds, i - 1)


# The setters of these CausalLMs ask the process's parallel state, not
# self.pp_group, whether this is the last PP rank.
_LAST_PP_RANK = types.SimpleNamespace(pp_group=ONLY_RANK)


class TestAuxPackerPlainLoops(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        # Index 0 is the embedding; num_layers the last layer's output, taken at
        # the final norm, apart from the norm's in-place update.
        layers_to_capture = [0, 1, 3, NUM_LAYERS]
        for spec in MODELS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                model = _model(spec, layers_to_capture)
                hidden, aux = _run(model, embeds.clone())
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(
                    tuple(aux.shape), (TOKENS, len(layers_to_capture) * HIDDEN)
                )
                torch.testing.assert_close(
                    aux, expected_captures(embeds, layers_to_capture)
                )
                torch.testing.assert_close(hidden, _stream(embeds, NUM_LAYERS) * 0.5)
                # The logits processor hands it on as it is: no concatenation.
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        layers_to_capture = [1, NUM_LAYERS]
        for spec in MODELS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                shared = torch.full((TOKENS + 3, 2 * HIDDEN), float("nan"))
                model = _model(spec, layers_to_capture)
                _, aux = _run(
                    model, embeds.clone(), shared[:TOKENS], ForwardMode.DECODE
                )
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                torch.testing.assert_close(
                    shared[:TOKENS], expected_captures(embeds, layers_to_capture)
                )
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_idle_batch_gives_an_empty_packed_buffer(self):
        for spec in MODELS:
            if not spec.idle:
                continue
            with self.subTest(model=spec.name):
                model = _model(spec, [1, NUM_LAYERS])
                _, aux = _run(model, torch.randn(0, HIDDEN), None, ForwardMode.IDLE)
                self.assertIsInstance(aux, torch.Tensor)
                self.assertEqual(tuple(aux.shape), (0, 2 * HIDDEN))

    def test_no_capture_returns_hidden_states_alone(self):
        for spec in MODELS:
            with self.subTest(model=spec.name):
                embeds = torch.randn(TOKENS, HIDDEN)
                out = _run(_model(spec), embeds.clone())
                self.assertIsInstance(out, torch.Tensor)
                torch.testing.assert_close(out, _stream(embeds, NUM_LAYERS) * 0.5)

    def test_pipeline_stage_counts_its_own_captures(self):
        for spec in MODELS:
            if not spec.pipeline:
                continue
            with self.subTest(model=spec.name):
                model = _model(spec, [1, 2, 3, NUM_LAYERS])
                model.start_layer, model.end_layer = 2, 3
                # index 2 at the input of layer 2, index 3 at the stage's end
                self.assertEqual(model.num_aux_captures(), 2)

    @mock.patch.object(minimax_m2, "get_parallel", return_value=_LAST_PP_RANK)
    @mock.patch.object(exaone_moe, "get_parallel", return_value=_LAST_PP_RANK)
    def test_causal_lm_reports_the_packed_width(self, *_):
        for spec in MODELS:
            setters = (
                ("set_eagle3_layers_to_capture", [0, NUM_LAYERS - 1], 2),
                ("set_dflash_layers_to_capture", list(spec.dflash_ids), 3),
            )
            for cls, build in _width_reporters(spec):
                for setter, layer_ids, num_captures in setters:
                    if not hasattr(cls, setter):
                        continue  # a DFlash-only target
                    with self.subTest(model=cls.__name__, setter=setter):
                        lm = build()
                        self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                        getattr(lm, setter)(layer_ids)
                        self.assertEqual(
                            lm.get_aux_hidden_states_width(), num_captures * HIDDEN
                        )

    def test_bailing_flagged_layer_adds_its_gathered_capture(self):
        # A layer flagged _is_layer_to_capture captures its own input into the
        # collector: one more slot, in layer order.
        model = _model(_spec(BailingMoEModel), [1, NUM_LAYERS])
        model.layers[2]._is_layer_to_capture = True
        embeds = torch.randn(TOKENS, HIDDEN)
        _, aux = _run(model, embeds.clone())
        torch.testing.assert_close(aux, expected_captures(embeds, [1, 2, NUM_LAYERS]))

    def test_draft_classes_report_no_width(self):
        # Neither draft sets capture_aux_hidden_states; the NextN one also swaps
        # the model for its own.
        drafts = (
            (ExaoneMoEForCausalLMMTP, _model(_spec(ExaoneMoEModel))),
            (LongcatFlashForCausalLMNextN, nn.Module()),
        )
        for lm_cls, model in drafts:
            with self.subTest(model=lm_cls.__name__):
                lm = _new(lm_cls, model=model, config=CONFIG, pp_group=ONLY_RANK)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)


# ---------------------------------------------------------------------------
# Qwen3-VL's language models: the loop of Qwen3Model / Qwen3MoeModel, with the
# deepstack embeddings added to the stream after layers 0 .. NUM_DEEPSTACK - 1.
# ---------------------------------------------------------------------------

NUM_DEEPSTACK = 3
# id i: the stream entering layer i; NUM_LAYERS: the last layer's output, taken at
# the final norm.
VL_IDS = (1, 3, NUM_LAYERS)
VL_MODELS = (
    (Qwen3LLMModel, Qwen3VLForConditionalGeneration),
    (Qwen3MoeLLMModel, Qwen3VLMoeForConditionalGeneration),
)


def _vl_model(model_cls, ids=()):
    return _new(
        model_cls,
        layers=nn.ModuleList(StreamLayer(i) for i in range(NUM_LAYERS)),
        start_layer=0,
        end_layer=NUM_LAYERS,
        layers_to_capture=list(ids),
        norm=InPlaceNorm(),
        pp_group=ONLY_RANK,
        hidden_size=HIDDEN,
        deepstack_embed_to_decoder_layer=range(NUM_DEEPSTACK),
        use_hf_deepstack_order=False,
    )


def _vl_wrapper(wrapper_cls, language_model):
    return _new(
        wrapper_cls,
        model=language_model,
        config=CONFIG,
        pp_group=ONLY_RANK,
        capture_aux_hidden_states=False,
    )


def _vl_forward(model, embeds, deepstack=None, buffer=None):
    extra = {} if deepstack is None else {"input_deepstack_embeds": deepstack}
    mode = ForwardMode.EXTEND if embeds.shape[0] else ForwardMode.IDLE
    return _run(model, embeds.clone(), buffer, mode, **extra)


def _vl_reference(embeds, deepstack=None):
    """The value of each capture id, and the final norm's output."""
    values, x = [], embeds
    for j in range(NUM_LAYERS):
        values.append(x)
        x = x + float(j + 1)
        if deepstack is not None and j < NUM_DEEPSTACK:
            x = x + deepstack[:, j * HIDDEN : (j + 1) * HIDDEN]
    return values + [x], x * 0.5


def _vl_cases():
    for model_cls, wrapper_cls in VL_MODELS:
        for deepstack in (False, True):
            embeds = torch.randn(TOKENS, HIDDEN)
            stack = torch.randn(TOKENS, NUM_DEEPSTACK * HIDDEN) if deepstack else None
            name = model_cls.__name__ + ("+deepstack" if deepstack else "")
            yield name, model_cls, wrapper_cls, embeds, stack


class TestQwen3VLLanguageModelsPack(CustomTestCase):
    def test_forward_returns_one_packed_buffer(self):
        for name, model_cls, _, embeds, stack in _vl_cases():
            with self.subTest(model=name):
                hidden, aux = _vl_forward(_vl_model(model_cls, VL_IDS), embeds, stack)
                values, final = _vl_reference(embeds, stack)
                self.assertIsInstance(aux, torch.Tensor)
                expected = torch.cat([values[i] for i in VL_IDS], dim=-1)
                torch.testing.assert_close(aux, expected)
                torch.testing.assert_close(hidden, final)
                self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_decode_graph_buffer_is_filled_in_place(self):
        ids = (VL_IDS[0], VL_IDS[-1])
        for name, model_cls, _, embeds, stack in _vl_cases():
            with self.subTest(model=name):
                shared = torch.full((TOKENS + 3, len(ids) * HIDDEN), float("nan"))
                _, aux = _vl_forward(
                    _vl_model(model_cls, ids), embeds, stack, buffer=shared[:TOKENS]
                )
                self.assertEqual(
                    aux.untyped_storage().data_ptr(),
                    shared.untyped_storage().data_ptr(),
                )
                values, _ = _vl_reference(embeds, stack)
                expected = torch.cat([values[i] for i in ids], dim=-1)
                torch.testing.assert_close(shared[:TOKENS], expected)
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())

    def test_idle_batch_and_no_capture(self):
        for model_cls, _ in VL_MODELS:
            with self.subTest(model=model_cls.__name__):
                hidden, aux = _vl_forward(
                    _vl_model(model_cls, VL_IDS), torch.zeros(0, HIDDEN)
                )
                self.assertEqual(tuple(aux.shape), (0, len(VL_IDS) * HIDDEN))
                embeds = torch.randn(TOKENS, HIDDEN)
                out = _vl_forward(_vl_model(model_cls), embeds)
                self.assertIsInstance(out, torch.Tensor)
                torch.testing.assert_close(out, _vl_reference(embeds)[1])

    def test_wrapper_reports_the_packed_width(self):
        for model_cls, wrapper_cls in VL_MODELS:
            with self.subTest(model=wrapper_cls.__name__):
                lm = _vl_wrapper(wrapper_cls, _vl_model(model_cls))
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                width = lm.get_aux_hidden_states_width()
                self.assertEqual(width, 3 * HIDDEN)
                shared = torch.full((TOKENS, width), float("nan"))
                _, aux = _vl_forward(
                    lm.model, torch.randn(TOKENS, HIDDEN), buffer=shared
                )
                self.assertFalse(torch.isnan(shared).any())
                # A wrapper over a language model that does not pack: no width.
                other = _vl_wrapper(wrapper_cls, nn.Module())
                other.set_dflash_layers_to_capture([0, 2, NUM_LAYERS - 1])
                self.assertTrue(other.capture_aux_hidden_states)
                self.assertEqual(other.get_aux_hidden_states_width(), 0)


# ---------------------------------------------------------------------------
# DeepseekV2Model and MiMoV2Model (and Kimi-K2.5's wrapper around the first):
# they count their captures, fill a DFlash decode graph's buffer in place and
# report the packed width.
# ---------------------------------------------------------------------------

# Draft ids (layer outputs) 0, 1, 2: capture indices 1, 2, 3, in the layer loop.
DRAFT_IDS = [0, 1, 2]
DFLASH = types.SimpleNamespace(is_dflash_family=lambda: True)
DS_MODELS = {
    "deepseek_v2": ModelSpec(
        DeepseekV2Model,
        (DeepseekV2ForCausalLM,),
        layer_cls=_TopKLayer,
        attrs=dict(
            config=CONFIG,
            use_dsa=False,
            first_k_dense_replace=0,
            llama_4_scaling_config=None,
            next_full_attention_layer_id={},
        ),
    ),
    "mimo_v2": ModelSpec(MiMoV2Model, (MiMoV2ForCausalLM,), attrs=dict(config=CONFIG)),
}


def _ds_causal_lm(name):
    """The CausalLM the model runner holds, over its real model class."""
    spec = DS_MODELS[name]
    return _causal_lm(spec, spec.lm_classes[0])


def _ds_run(model, embeds, buffer=None):
    batch = forward_batch(aux_buffer=buffer, return_hidden_states_before_norm=False)
    out = model.forward(None, torch.arange(embeds.shape[0]), batch, input_embeds=embeds)
    return out[-1]


class TestDeepseekMiMoAuxBuffer(CustomTestCase):
    def test_width_is_reported_after_the_dflash_setter(self):
        for name in ("deepseek_v2", "mimo_v2"):
            with self.subTest(model=name):
                lm = _ds_causal_lm(name)
                self.assertEqual(lm.get_aux_hidden_states_width(), 0)
                lm.set_dflash_layers_to_capture(DRAFT_IDS)
                want = len(DRAFT_IDS) * HIDDEN
                self.assertEqual(lm.get_aux_hidden_states_width(), want)
                for draft_worker, width in ((False, want), (True, 0)):
                    self.assertEqual(
                        resolve_aux_hidden_states_width(
                            model=lm,
                            spec_algorithm=DFLASH,
                            is_draft_worker=draft_worker,
                        ),
                        width,
                    )

    def test_kimi_k25_reports_its_language_model_width(self):
        wrapper = kimi_k25.KimiK25ForConditionalGeneration.__new__(
            kimi_k25.KimiK25ForConditionalGeneration
        )
        nn.Module.__init__(wrapper)
        wrapper.language_model = _ds_causal_lm("deepseek_v2")
        wrapper.set_dflash_layers_to_capture(DRAFT_IDS)
        self.assertEqual(
            resolve_aux_hidden_states_width(
                model=wrapper, spec_algorithm=DFLASH, is_draft_worker=False
            ),
            len(DRAFT_IDS) * HIDDEN,
        )

    def test_decode_graph_buffer_is_filled_in_place(self):
        for name in ("deepseek_v2", "mimo_v2"):
            with self.subTest(model=name):
                lm = _ds_causal_lm(name)
                lm.set_dflash_layers_to_capture(DRAFT_IDS)
                embeds = torch.randn(TOKENS, HIDDEN)
                packed = _ds_run(lm.model, embeds.clone())
                width = lm.get_aux_hidden_states_width()
                self.assertEqual(tuple(packed.shape), (TOKENS, width))
                # Capture index i is the output of layer i - 1: the embedding plus
                # 1 + ... + i.
                for slot, index in enumerate(i + 1 for i in DRAFT_IDS):
                    torch.testing.assert_close(
                        packed[:, slot * HIDDEN : (slot + 1) * HIDDEN],
                        embeds + float(sum(range(1, index + 1))),
                    )
                shared = torch.full((TOKENS + 3, width), float("nan"))
                aux = _ds_run(lm.model, embeds.clone(), buffer=shared[:TOKENS])
                self.assertEqual(aux.data_ptr(), shared.data_ptr())
                torch.testing.assert_close(shared[:TOKENS], packed)
                self.assertTrue(torch.isnan(shared[TOKENS:]).all())


if __name__ == "__main__":
    unittest.main()
