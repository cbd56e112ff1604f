"""The list path of the aux hidden states is gone on 0.5.23 (aux-hidden-state-list-removed).

Once every capturing model packs its captures (pipeline stages included), nothing
creates an ``AuxHiddenStateList``: the patch removes it, the logits processor and the
eager runner keep only the packed tensor's path, and ``pack_aux_hidden_states`` refuses
a list instead of concatenating it (which would hold the captures twice). Checked
against the pristine 0.5.23 logits processor, loaded from the release's verified wheel
under a module name of its own: its real forward on a list of K captures hands the
draft what the patched one hands it for the same captures packed, in every pruning
path, with perturbed, distinct captures and the whole tensors compared; and the EAGLE3
drafts' real forwards, which the release's hand on as a list of one, against the
release's own (both drafts, before and after their final norm).
"""

from __future__ import annotations

import pkgutil

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("aux-hidden-state-list-removed")

H, K, V = 16, 3, 64
LENS = [3, 5, 2]


@GUARD
def test_a_list_is_refused_in_one_line_naming_the_packer():
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    caps = [torch.randn(4, H) for _ in range(K)]
    with pytest.raises(TypeError) as exc:
        pack_aux_hidden_states(caps)
    assert "AuxHiddenStatePacker" in str(exc.value) and "\n" not in str(exc.value)
    packed = torch.cat(caps, dim=-1)
    assert pack_aux_hidden_states(packed) is packed


@GUARD
def test_no_module_of_sglang_srt_names_the_list():
    import sglang.srt
    from sglang.srt.layers import aux_hidden_states

    assert not hasattr(aux_hidden_states, "AuxHiddenStateList")
    assert aux_hidden_states.AuxHiddenStateAccumulator is aux_hidden_states.AuxHiddenStatePacker
    root = sglang.srt.__path__[0]
    naming = []
    for info in pkgutil.walk_packages([root], "sglang.srt."):
        if info.ispkg:
            continue
        path = f"{root}/{info.name.removeprefix('sglang.srt.').replace('.', '/')}.py"
        try:
            text = open(path, encoding="utf-8").read()
        except FileNotFoundError:
            continue
        if "AuxHiddenStateList" in text:
            naming.append(info.name)
    assert naming == []


@pytest.fixture(scope="module")
def processors(sglang_tp1):
    """(pristine 0.5.23 LogitsProcessor, patched LogitsProcessor, lm head)."""
    from sglang.srt.layers import logits_processor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    from harness.memory.models import pristine_module

    pristine = pristine_module("srt/layers/logits_processor.py")
    head = ParallelLMHead(V, H)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=torch.Generator().manual_seed(3)))
    return pristine, logits_processor, head


def _metadata(module, case, capture):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    mode = {"full": CaptureHiddenMode.FULL, "last": CaptureHiddenMode.LAST}[capture]
    meta = module.LogitsMetadata
    if case == "decode":
        return meta(forward_mode=ForwardMode.DECODE, capture_hidden_mode=mode), 4
    if case == "draft-extend":
        return meta(forward_mode=ForwardMode.DRAFT_EXTEND_V2, capture_hidden_mode=mode,
                    extend_seq_lens=torch.tensor(LENS), extend_seq_lens_cpu=LENS), sum(LENS)
    if case == "extend":
        return meta(forward_mode=ForwardMode.EXTEND, capture_hidden_mode=mode,
                    extend_seq_lens=torch.tensor(LENS), extend_seq_lens_cpu=LENS), sum(LENS)
    starts = [0, 5, 1]  # one chunk with no logprob token, as chunked prefill has
    return meta(forward_mode=ForwardMode.EXTEND, capture_hidden_mode=mode,
                extend_return_logprob=True, extend_seq_lens=torch.tensor(LENS),
                extend_seq_lens_cpu=LENS, extend_logprob_start_lens_cpu=starts,
                extend_logprob_pruned_lens_cpu=[n - s for n, s in zip(LENS, starts)],
                extend_input_logprob_token_ids_gpu=torch.arange(sum(LENS) - sum(starts)) % V,
                ), sum(LENS)


@GUARD
@pytest.mark.parametrize("capture", ["full", "last"])
@pytest.mark.parametrize("case", ["decode", "draft-extend", "extend", "extend-logprob"])
def test_packed_captures_reach_the_draft_as_the_release_hands_on_a_list(processors, case,
                                                                          capture):
    pristine, patched, head = processors
    g = torch.Generator().manual_seed(11)
    _, n = _metadata(patched, case, capture)
    hidden = torch.randn(n, H, generator=g)
    caps = [torch.randn(n, H, generator=g) * (j + 2) + j for j in range(K)]
    ids = torch.arange(n)
    with torch.no_grad():
        want = pristine.LogitsProcessor(_config())(
            ids, hidden.clone(), head, _metadata(pristine, case, capture)[0],
            [c.clone() for c in caps])
        got = patched.LogitsProcessor(_config())(
            ids, hidden.clone(), head, _metadata(patched, case, capture)[0],
            torch.cat(caps, dim=-1))
    assert want.hidden_states is not None and want.hidden_states.shape[-1] == K * H
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, rtol=0, atol=0)
    with pytest.raises(TypeError, match="AuxHiddenStatePacker"), torch.no_grad():
        patched.LogitsProcessor(_config())(
            ids, hidden.clone(), head, _metadata(patched, case, capture)[0], caps)


def _config():
    from transformers import PretrainedConfig

    return PretrainedConfig(vocab_size=V, hidden_size=H)


# The EAGLE3 drafts, whose one capture (the draft's hidden state for its next step) the
# release handed its logits processor as a list of one: (file, model class, the
# attribute holding its decoder layers).
DRAFTS = {
    "llama_eagle3": ("srt/models/llama_eagle3.py", "LlamaModel", "layers"),
    "kimi_k25_eagle3": ("srt/models/kimi_k25_eagle3.py", "Eagle3MLAModel", "midlayer"),
}


class _DraftLayer(torch.nn.Module):
    """A draft decoder layer stand-in: (stream, residual) out of (embeds, stream)."""

    def forward(self, positions, embeds, hidden_states, forward_batch, *rest):
        return hidden_states * 1.5 + embeds, hidden_states.clone()


def _draft(module, name, norm_output):
    """``module``'s real draft model of ``DRAFTS[name]``: its forward, one stand-in
    layer, the scaffold's fused add + norm (in place, as the GPU kernel)."""
    from torch import nn

    from sglang.test.aux_capture_test_utils import InPlaceNorm

    _, cls_name, stack = DRAFTS[name]
    cls = getattr(module, cls_name)
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.is_mrope_enabled = False
    model.input_norm = model.fc_norm = None
    setattr(model, stack, nn.ModuleList([_DraftLayer()]) if stack == "layers" else _DraftLayer())
    model.norm = InPlaceNorm()
    model.norm_output = norm_output
    return model


@GUARD
@pytest.mark.parametrize("norm_output", [False, True], ids=["pre-norm", "norm-output"])
@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_eagle3_drafts_pack_what_the_release_concatenated(processors, name, norm_output):
    """The draft's real forward, then the real logits processor, pristine 0.5.23's
    (a list of one) and the series' (one packed tensor), on the same inputs: the same
    capture in storage of its own (the release's ``torch.cat`` copied it), and the same
    hidden state and logits for the draft's next step."""
    import importlib
    import types

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from harness.memory.models import pristine_module

    pristine_lp, patched_lp, head = processors
    rel = DRAFTS[name][0]
    trees = [(pristine_module(rel), pristine_lp),
             (importlib.import_module("sglang." + rel.removesuffix(".py").replace("/", ".")),
              patched_lp)]
    g = torch.Generator().manual_seed(5)
    stream, embeds = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
    runs = []
    for module, lp in trees:
        batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE,
                                      spec_info=types.SimpleNamespace(hidden_states=stream.clone()))
        with torch.no_grad():
            hidden, aux = _draft(module, name, norm_output)(None, None, batch,
                                                            input_embeds=embeds.clone())
            out = lp.LogitsProcessor(_config())(torch.arange(4), hidden, head,
                                                _metadata(lp, "decode", "last")[0], aux)
        runs.append((hidden, aux, out))
    (_, want_aux, want), (hidden, aux, got) = runs
    assert isinstance(want_aux, list) and len(want_aux) == 1
    assert isinstance(aux, torch.Tensor), type(aux)
    torch.testing.assert_close(aux, torch.cat(want_aux, dim=-1), rtol=0, atol=0)
    assert aux.data_ptr() != hidden.data_ptr()
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, rtol=0, atol=0)
