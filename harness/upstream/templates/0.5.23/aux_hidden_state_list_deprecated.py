# upstream-path: test/registered/unit/models/test_aux_hidden_state_list_deprecated.py
"""Every capturing model packs its aux hidden states, pipeline stages included,
and the list path is deprecated.

A list of K captures that the logits processor concatenates holds the captures
and their concatenation at once (2 x K x T x H). KimiK3LinearModel and
KimiLinearModel packed them into one [T, K * H] buffer (AuxHiddenStatePacker)
without pipeline parallelism only; with PP > 1 each stage collected a list, a
stage that is not the last concatenated its own into
``pp_proxy_tensors["dspark_hidden_states"]``, and the last one concatenated the
received block with its own captures. Now every stage packs: a later stage
copies the received block (K' captures side by side) into its first K' slots,
then its own captures; a stage that is not the last sends its packed buffer on
as it is. Capture ids are layer outputs: on the standard residual path layer
i's input captures the output of layer i - 1 (a stage's first layer the
previous stage's last one) and the final norm the last layer's; on kimi_k3's
attention-residual bank path the mixture after layer i is captured, the
previous stage's last one at the stage's start. A DFlash-family decode CUDA
graph passes a slice of one shared buffer on the batch
(aux_hidden_states_buffer), sized by get_aux_hidden_states_width, on every
stage. The EAGLE3 drafts hand their one capture on as it is (K = 1 is packed),
without a copy. With no list left in the tree, AuxHiddenStateList is deprecated:
a list an out-of-tree model returns is still concatenated, with one warning
naming the packer, for one release.

DeepseekV2Model and MiMoV2Model already packed, but sized their packer with
``len(layers_to_capture)`` and ignored a DFlash decode graph's shared buffer,
and their CausalLMs (and Kimi-K2.5's wrapper) reported no width: each graph
size kept a packed output of its own. They now count their captures, fill
the batch's slice in place and report K * hidden.

Runs on CPU without a GPU or a checkpoint: the decoder layers, the final read
and the bank are small stand-ins on the real residual stream
(``forward_batch.residual_stream``, sglang.test.aux_capture_test_utils), the
bank's mixture a snapshot of the stream; the models' forwards are the real
ones, run stage by stage with the pipeline group overridden.
"""

import types
import unittest

import torch
from torch import nn

from sglang.srt.layers import aux_hidden_states
from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.model_executor.forward_batch_info import PPProxyTensors
from sglang.srt.model_executor.model_runner_components.misc_utils import (
    resolve_aux_hidden_states_width,
)
from sglang.srt.models import deepseek_v2, kimi_k25, mimo_v2
from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM, KimiK3LinearModel
from sglang.srt.models.kimi_linear import KimiLinearForCausalLM, KimiLinearModel
from sglang.srt.models.llama_eagle3 import LlamaModel as Eagle3LlamaModel
from sglang.srt.runtime_context import get_parallel
from sglang.test.aux_capture_test_utils import (
    InPlaceNorm,
    StreamLayer,
    forward_batch,
    stream_after,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

HIDDEN = 8
TOKENS = 5
NUM_LAYERS = 4
SPLIT = 2  # the first stage takes layers 0 and 1, the last 2 and 3


class _FromPP:
    """A pipeline stage's entry: a fresh stream holding the received output."""

    def from_pp(self, pp_proxy_tensors, forward_batch):
        residual_batch.start(forward_batch)
        return pp_proxy_tensors["hidden_states"] + pp_proxy_tensors.tensors.get(
            "residual", 0
        )


class _Layer(StreamLayer):
    """The scaffold's layer with a pipeline entry; kimi_k3 hands its collector
    as ``capture_gathered``, as its attention boundary takes it."""

    def __init__(self, layer_id):
        super().__init__(layer_id)
        self.attn_boundary = _FromPP()

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


def _model(layer_ids=None, start_layer=0, end_layer=NUM_LAYERS, bank=False):
    model = KimiK3LinearModel.__new__(KimiK3LinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = start_layer, end_layer
    model.dspark_layers_to_capture = None if layer_ids is None else list(layer_ids)
    model.carries_bank_slices = False
    model._final_read = InPlaceNorm()
    model.attn_bank = _Bank() if bank else None
    if bank:
        # The bank's capture is the mixture the next read would form; here the
        # stream itself, so both paths capture the same values.
        model._dspark_capture_stream = lambda layer_id, hidden, batch: (
            residual_batch.snapshot(hidden, batch)
        )
    whole = start_layer == 0 and end_layer == NUM_LAYERS
    model.pp_group = types.SimpleNamespace(
        is_first_rank=start_layer == 0,
        is_last_rank=end_layer == NUM_LAYERS,
        world_size=1 if whole else 2,
    )
    model.config = types.SimpleNamespace(hidden_size=HIDDEN, attn_res_block_size=2)
    return model


def _run(model, embeds, buffer=None, pp_proxy_tensors=None):
    with get_parallel().override(pp_group=model.pp_group):
        return model.forward(
            input_ids=None,
            positions=torch.arange(embeds.shape[0]),
            forward_batch=forward_batch(aux_buffer=buffer),
            inputs_embeds=embeds,
            pp_proxy_tensors=pp_proxy_tensors,
        )


def _two_stages(layer_ids, embeds, bank=False, buffers=(None, None), model=None):
    """(what the first stage sends, what the last returns), each stage the real
    forward of its own model."""
    model = model or (lambda ids, **stage: _model(ids, bank=bank, **stage))
    proxy = _run(model(layer_ids, end_layer=SPLIT), embeds.clone(), buffers[0])
    out = _run(
        model(layer_ids, start_layer=SPLIT),
        torch.empty(0, HIDDEN),
        buffers[1],
        pp_proxy_tensors=PPProxyTensors(dict(proxy.tensors)),
    )
    return proxy, out


def _after(embeds, layer_id):
    # The output of layer ``layer_id``, what capture id ``layer_id`` holds.
    return stream_after(embeds, layer_id)


def _expected(embeds, layer_ids):
    return torch.cat([_after(embeds, i) for i in layer_ids], dim=-1)


class TestKimiK3PipelineStagesPack(CustomTestCase):
    def _check_packed(self, hidden, aux, embeds, layer_ids):
        # One [T, K * H] tensor holding the captures in order, the final norm's
        # output beside it, and the logits processor hands it on as it is.
        self.assertIsInstance(aux, torch.Tensor)
        self.assertEqual(tuple(aux.shape), (TOKENS, len(layer_ids) * HIDDEN))
        torch.testing.assert_close(aux, _expected(embeds, layer_ids))
        torch.testing.assert_close(hidden, _after(embeds, NUM_LAYERS - 1) * 0.5)
        self.assertIs(pack_aux_hidden_states(aux), aux)

    def test_single_stage_returns_one_packed_buffer(self):
        layer_ids = [0, 2, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)
        for bank in (False, True):
            hidden, aux = _run(_model(layer_ids, bank=bank), embeds.clone())
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

    def test_post_norm_last_capture_fills_the_last_slot(self):
        # post_norm: the last layer's capture is the final read's output.
        from sglang.srt.layers.aux_hidden_states import set_final_layer_capture

        layer_ids = [0, 1, NUM_LAYERS - 1]
        embeds = torch.randn(TOKENS, HIDDEN)

        def post_norm(bank):
            def build(ids, **stage):
                model = _model(ids, bank=bank, **stage)
                set_final_layer_capture(model, "post_norm")
                return model

            return build

        for bank in (False, True):
            _, (hidden, aux) = _two_stages(layer_ids, embeds, model=post_norm(bank))
            torch.testing.assert_close(aux[:, : 2 * HIDDEN], _expected(embeds, [0, 1]))
            torch.testing.assert_close(aux[:, 2 * HIDDEN :], hidden)
            torch.testing.assert_close(hidden, _after(embeds, NUM_LAYERS - 1) * 0.5)

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
        self.assertIsInstance(_run(_model(), embeds.clone()), torch.Tensor)
        proxy, out = _two_stages(None, embeds)
        self.assertNotIn("dspark_hidden_states", proxy.tensors)
        self.assertIsInstance(out, torch.Tensor)

    def test_causal_lm_reports_the_packed_width_per_stage(self):
        def causal_lm(**stage):
            lm = KimiK3LinearForCausalLM.__new__(KimiK3LinearForCausalLM)
            nn.Module.__init__(lm)
            lm.model = _model(**stage)
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


def _kimi_linear(layer_ids=None, start_layer=0, end_layer=NUM_LAYERS):
    model = KimiLinearModel.__new__(KimiLinearModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([_Layer(i) for i in range(NUM_LAYERS)])
    model.start_layer, model.end_layer = start_layer, end_layer
    model.dspark_layers_to_capture = None if layer_ids is None else list(layer_ids)
    model.norm = InPlaceNorm()
    model.pp_group = types.SimpleNamespace(
        is_first_rank=start_layer == 0,
        is_last_rank=end_layer == NUM_LAYERS,
        world_size=1 if (start_layer, end_layer) == (0, NUM_LAYERS) else 2,
    )
    model.config = types.SimpleNamespace(hidden_size=HIDDEN)
    return model


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
        torch.testing.assert_close(hidden, _after(embeds, NUM_LAYERS - 1) * 0.5)

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


class _DraftLayer(nn.Module):
    """An EAGLE3 draft decoder layer: adds the embeddings to the stream and hands
    the stream it took as the residual."""

    def forward(self, positions, embeds, hidden_states, forward_batch, residual):
        return hidden_states + embeds, hidden_states.clone()


def _eagle3_draft(norm_output):
    model = Eagle3LlamaModel.__new__(Eagle3LlamaModel)
    nn.Module.__init__(model)
    model.is_mrope_enabled = False
    model.input_norm = model.fc_norm = None
    model.layers = nn.ModuleList([_DraftLayer()])
    model.norm = InPlaceNorm()
    model.norm_output = norm_output
    return model


class TestEagle3DraftHandsOnItsCapture(CustomTestCase):
    def test_the_draft_hands_on_its_capture_without_a_copy(self):
        for norm_output in (False, True):
            with self.subTest(norm_output=norm_output):
                stream = torch.randn(TOKENS, HIDDEN)
                embeds = torch.randn(TOKENS, HIDDEN)
                batch = forward_batch(
                    spec_info=types.SimpleNamespace(hidden_states=stream.clone())
                )
                model = _eagle3_draft(norm_output)
                normed = []
                model.norm.register_forward_hook(
                    lambda module, args, out: normed.append(out)
                )
                hidden, aux = model(None, None, batch, input_embeds=embeds)
                # The fused add + norm: residual stream + layer output, then halved.
                pre_norm = 2 * stream + embeds
                want = pre_norm * 0.5 if norm_output else pre_norm
                self.assertIsInstance(aux, torch.Tensor)
                self.assertIs(pack_aux_hidden_states(aux), aux)
                torch.testing.assert_close(aux, want)
                torch.testing.assert_close(hidden, pre_norm * 0.5)
                # K = 1 is packed already: the final norm's output itself.
                (out,) = normed
                self.assertIs(aux, out[0] if norm_output else out[1])

    def test_an_idle_draft_batch_hands_on_no_tokens(self):
        batch = forward_batch(
            spec_info=types.SimpleNamespace(hidden_states=torch.empty(0, HIDDEN))
        )
        hidden, aux = _eagle3_draft(False)(
            None, None, batch, input_embeds=torch.empty(0, HIDDEN)
        )
        self.assertEqual(tuple(pack_aux_hidden_states(aux).shape), (0, HIDDEN))


class TestListPathDeprecated(CustomTestCase):
    def setUp(self):
        aux_hidden_states._list_deprecation_warned = False

    def test_in_tree_models_capture_into_the_packer(self):
        self.assertIs(
            aux_hidden_states.AuxHiddenStateAccumulator,
            aux_hidden_states.AuxHiddenStatePacker,
        )

    def test_a_list_is_concatenated_once_with_one_warning(self):
        captures = [torch.randn(TOKENS, HIDDEN) for _ in range(3)]
        packed = torch.cat(captures, dim=-1)
        self.assertIs(pack_aux_hidden_states(packed), packed)
        with self.assertLogs(aux_hidden_states.logger, "WARNING") as logs:
            torch.testing.assert_close(pack_aux_hidden_states(captures), packed)
            self.assertIs(pack_aux_hidden_states(captures[:1]), captures[0])
        self.assertEqual(len(logs.records), 1)
        self.assertIn("AuxHiddenStatePacker", logs.records[0].getMessage())

    def test_the_deprecated_list_still_collects(self):
        borrowed, owned = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
        with self.assertLogs(aux_hidden_states.logger, "WARNING"):
            collected = aux_hidden_states.AuxHiddenStateList()
        collected.capture(borrowed)
        collected.capture(owned, owned=True)
        torch.testing.assert_close(collected[0], borrowed)
        self.assertNotEqual(collected[0].data_ptr(), borrowed.data_ptr())
        self.assertIs(collected[1], owned)


# Draft ids (layer outputs) 0, 1, 2: capture indices 1, 2, 3, in the layer loop.
DRAFT_IDS = [0, 1, 2]
DFLASH = types.SimpleNamespace(is_dflash_family=lambda: True)


def _deepseek_model():
    model = deepseek_v2.DeepseekV2Model.__new__(deepseek_v2.DeepseekV2Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList(
        [StreamLayer(i, returns_topk=True) for i in range(NUM_LAYERS)]
    )
    model.use_dsa = False
    model.first_k_dense_replace = 0
    model.llama_4_scaling_config = None
    model.next_full_attention_layer_id = {}
    return model


def _mimo_model():
    model = mimo_v2.MiMoV2Model.__new__(mimo_v2.MiMoV2Model)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([StreamLayer(i) for i in range(NUM_LAYERS)])
    return model


def _ds_causal_lm(name):
    """The CausalLM the model runner holds, over its real model class."""
    cls, model = {
        "deepseek_v2": (deepseek_v2.DeepseekV2ForCausalLM, _deepseek_model),
        "mimo_v2": (mimo_v2.MiMoV2ForCausalLM, _mimo_model),
    }[name]
    model = model()
    model.start_layer, model.end_layer = 0, NUM_LAYERS
    model.layers_to_capture = []
    model.norm = InPlaceNorm()
    model.config = types.SimpleNamespace(
        num_hidden_layers=NUM_LAYERS, hidden_size=HIDDEN
    )
    model.pp_group = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    lm = cls.__new__(cls)
    nn.Module.__init__(lm)
    lm.model = model
    lm.config = model.config
    lm.pp_group = model.pp_group
    lm.capture_aux_hidden_states = False
    return lm


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
