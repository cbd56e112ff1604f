"""The list path of the aux hidden states is deprecated on 0.5.23
(aux-hidden-state-list-deprecated).

Once every in-tree capturing model packs its captures (pipeline stages included), the
logits processor and the gathers work on the packed tensor alone: a list an out-of-tree
model still returns is packed once where it comes in, as the release packed it, with one
warning that names the packer, for one release. The EAGLE3 drafts hand their one
capture on as it is (K = 1 is packed), with no copy, as the release's list of one was
handed on. Checked against pristine 0.5.23, loaded from the release's verified wheel
under module names of their own: its ``pack_aux_hidden_states`` and
``AuxHiddenStateList`` on the same lists; its real logits processor on a list of K
captures, which must hand the draft what the patched one hands it for the same captures
packed and as a list, in every pruning path, with perturbed, distinct captures and the
whole tensors compared; and the EAGLE3 drafts' real forwards against the release's own
(both drafts, before and after their final norm), down to which tensor is handed on.
"""

from __future__ import annotations

import logging
import pkgutil

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.23")
GUARD = pytest.mark.guards("aux-hidden-state-list-deprecated")

H, K, V = 16, 3, 64
LENS = [3, 5, 2]
AUX_LOGGER = "sglang.srt.layers.aux_hidden_states"


@pytest.fixture
def fresh_warning(monkeypatch, caplog):
    """The patched module as if nothing had warned yet; its records."""
    from sglang.srt.layers import aux_hidden_states

    if hasattr(aux_hidden_states, "_list_deprecation_warned"):
        monkeypatch.setattr(aux_hidden_states, "_list_deprecation_warned", False)
    caplog.set_level(logging.WARNING, logger=AUX_LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == AUX_LOGGER]


def _release_aux():
    from harness.memory.models import pin_aux_module

    return pin_aux_module()


@GUARD
def test_a_list_packs_as_the_release_packs_it_with_one_warning(fresh_warning):
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    release = _release_aux()
    caps = [torch.randn(4, H) * (j + 1) + j for j in range(K)]
    got = pack_aux_hidden_states(caps)
    torch.testing.assert_close(got, release.pack_aux_hidden_states(caps), rtol=0, atol=0)
    one = [caps[0]]
    assert pack_aux_hidden_states(one) is release.pack_aux_hidden_states(one) is caps[0]
    packed = torch.cat(caps, dim=-1)
    assert pack_aux_hidden_states(packed) is packed
    warned = fresh_warning()
    assert len(warned) == 1, warned
    assert "AuxHiddenStatePacker" in warned[0] and "\n" not in warned[0]


@GUARD
def test_the_list_collector_still_collects_as_the_release_did(fresh_warning):
    from sglang.srt.layers import aux_hidden_states

    release = _release_aux()
    borrowed, owned = torch.randn(4, H), torch.randn(4, H)
    lists = []
    for module in (release, aux_hidden_states):
        collected = module.AuxHiddenStateList()
        collected.capture(borrowed)
        collected.capture(owned, owned=True)
        lists.append(collected)
    want, got = lists
    assert isinstance(got, list) and len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A borrowed value is copied, an owned one adopted, as the release's list does.
    assert got[0].data_ptr() != borrowed.data_ptr() and got[1] is owned
    aux_hidden_states.AuxHiddenStateList()
    assert len(fresh_warning()) == 1


@GUARD
def test_no_in_tree_module_collects_a_list():
    import sglang.srt
    from sglang.srt.layers import aux_hidden_states

    assert aux_hidden_states.AuxHiddenStateAccumulator is aux_hidden_states.AuxHiddenStatePacker
    root = sglang.srt.__path__[0]
    naming = []
    for info in pkgutil.walk_packages([root], "sglang.srt."):
        if info.ispkg or info.name == aux_hidden_states.__name__:
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


# Not a regression test (no guards mark): before the patch, too, the logits processor
# hands the draft a packed tensor as it hands on a list; this checks the patch keeps it so.
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
    with torch.no_grad():  # the deprecated list: what the release hands on
        listed = patched.LogitsProcessor(_config())(
            ids, hidden.clone(), head, _metadata(patched, case, capture)[0],
            [c.clone() for c in caps])
    torch.testing.assert_close(listed.hidden_states, want.hidden_states, rtol=0, atol=0)


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
def test_eagle3_drafts_hand_on_what_the_release_handed_on(processors, name, norm_output):
    """The draft's real forward, then the real logits processor, pristine 0.5.23's
    (a list of one, which its ``pack_aux_hidden_states`` hands on without a copy) and
    the series' (one tensor), on the same inputs: the tensor handed on is the one the
    final norm returned in both (no copy: the same storage relation to the draft's
    hidden states), equal values, and the same hidden state and logits for the draft's
    next step."""
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
        draft = _draft(module, name, norm_output)
        normed = []
        draft.norm.register_forward_hook(lambda m, args, out: normed.append(out))
        with torch.no_grad():
            hidden, aux = draft(None, None, batch, input_embeds=embeds.clone())
            handed = aux[0] if isinstance(aux, list) else aux
            out = lp.LogitsProcessor(_config())(torch.arange(4), hidden, head,
                                                _metadata(lp, "decode", "last")[0], aux)
        (norm_out,) = normed
        runs.append((hidden, aux, handed, norm_out[1 if not norm_output else 0], out))
    (want_hidden, want_aux, want_handed, want_norm, want), (hidden, aux, handed, norm, got) = runs
    assert isinstance(want_aux, list) and len(want_aux) == 1
    assert isinstance(aux, torch.Tensor), type(aux)
    assert want_handed is want_norm, "the release hands on the final norm's output itself"
    assert handed is norm, "the series copies the draft's capture: the release did not"
    assert (aux.data_ptr() == hidden.data_ptr()) == (want_handed.data_ptr() == want_hidden.data_ptr())
    torch.testing.assert_close(aux, want_handed, rtol=0, atol=0)
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(got.next_token_logits, want.next_token_logits, rtol=0, atol=0)
