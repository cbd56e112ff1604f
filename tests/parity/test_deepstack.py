"""Qwen3-VL deepstack against transformers, at TP 1 and 2 (FlashInfer fusion emulated
where the layers defer), for each ``deepstack_capture`` setting and, on 0.5.23, each of
its deepstack orders.

Every token is an image token with deepstack features for layers 0-2
(:mod:`harness.parity.deepstack`). SGLang's language models (dense ``Qwen3LLMModel``,
MoE ``Qwen3MoeLLMModel``), loaded from a tiny transformers checkpoint through SGLang's
own loader with every layer captured through the model runner's setup function, must
match transformers' language model fed ``visual_pos_masks`` and
``deepstack_visual_embeds``:

* a capture of index ``k <= 3`` holds transformers' ``hidden_states[k]`` (decoder layer
  ``k - 1``'s output, before its deepstack) under ``pre_deepstack``, and that plus
  ``deepstack[k - 1]`` on the image rows (the stream entering layer ``k``) under
  ``post_deepstack``; the other captures hold ``hidden_states[k]``, and the last one the
  stream entering the final norm, in every setting;
* unset, each base keeps its own release's value: ``pre_deepstack`` on the pin (what
  its Qwen3-VL loops captured); on 0.5.23 each deepstack order's own,
  ``post_deepstack`` on the inference path and ``pre_deepstack`` on the HF-order path
  of ``--rl-on-policy-target``;
* a ``pre_deepstack`` capture is decoder layer ``k - 1``'s output bit for bit: equal
  to the same capture of a forward whose deepstack for that layer alone is zero (a
  capture rebuilt from the sum, ``(x + d) - d``, is not). Not asserted for the pin's
  ``qwen3_vl_moe``: its layers capture inside the fused norm that adds the deepstack
  (after the all-reduce they defer), and the pin's deepstack-capture patch takes the
  stream less the deepstack, one rounding from the layer output (``BIT_EQUAL``);
* the final hidden states equal transformers' output (deepstack neither lost nor added
  once per rank when a layer defers its all-reduce).
"""

from __future__ import annotations

import pytest

from harness.parity import deepstack, reference
from harness.parity.families import families
from harness.parity.runner import ENV, INIT_FN, PRELOAD

pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), pytest.mark.parity]

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
TPS = (1, 2)
# Per base and deepstack order: the value of an unset deepstack_capture (the release's:
# 0.5.23's inference path captured after the addition, its HF-order path before it).
DEFAULT_POST = {("0.5.13.post1", "inference"): False, ("0.5.23", "inference"): True,
                ("0.5.23", "hf"): False}
# Per base: the families whose pre_deepstack capture is the layer output bit for bit.
BIT_EQUAL = {"0.5.13.post1": ("qwen3_vl",), "0.5.23": FAMILIES}
SETTING_PATCH = {"0.5.13.post1": "deepstack-capture-setting",
                 "0.5.23": "qwen3-vl-deepstack-capture"}


def _family(name):
    return deepstack.family(families()[name])


def _label() -> str:
    from harness.patchset.layout import layout

    return layout().label


def _active(fam) -> bool:
    return _label() in fam.bases


def _guards(name: str, tp: int, fusion: str, order: str, setting) -> list:
    """The patches whose bugs a case exercises.

    * Bug "V" of the survey (the pin's deepstack-capture): qwen3_vl_moe lost the
      deepstack where a layer deferred its all-reduce (TP > 1, fused), and since
      models-capture-after-allreduce its captures held it at every TP; the case of an
      unset setting shows it.
    * The setting's own patch: an explicit setting (no such setting without it). Unset,
      each order keeps the release's value, which pristine gives too.
    """
    from harness.standins.models import specs

    label = _label()
    out = []
    spec = specs().get(name)
    if (setting is None and label == "0.5.13.post1" and spec is not None
            and "V" in spec.bugs() and spec.patch_for("V") is not None
            and name == "qwen3_vl_moe"):
        out.append(spec.patch_for("V"))
    if setting is not None:
        out.append(SETTING_PATCH[label])
    return [pytest.mark.guards(p) for p in out]


def _orders() -> tuple:
    return deepstack.ORDERS if _label() == "0.5.23" else deepstack.ORDERS[:1]


def _params():
    for name in FAMILIES:
        fam = families().get(name)
        if fam is None:
            continue
        for tp in TPS:
            for fusion in fam.fusions(tp):
                for order in _orders():
                    for setting in deepstack.SETTINGS:
                        marks = [pytest.mark.multirank, pytest.mark.world_size(tp),
                                 *_guards(name, tp, fusion, order, setting)]
                        case_id = f"{name}-tp{tp}-{fusion}-{order}-{setting or 'unset'}"
                        yield pytest.param(name, tp, fusion, order, setting, id=case_id,
                                           marks=marks)


_RUNS: dict = {}


def _pool(rank_pool, tp: int, wait: bool = True):
    return rank_pool(tp, backend="gloo", init_fn=INIT_FN, env=dict(ENV), timeout=1200,
                     start_timeout=900, wait=wait, preload=PRELOAD)


@pytest.fixture(scope="module")
def deepstack_refs(selected_cases, rank_pool, tmp_path_factory):
    wanted = selected_cases("test_deepstack.py")
    for tp in sorted(set().union(*wanted.values())):
        _pool(rank_pool, tp, wait=False)
    root = tmp_path_factory.mktemp("deepstack")
    out = {}
    for name in FAMILIES:
        if name not in families() or not _active(families()[name]) or name not in wanted:
            continue
        fam = _family(name)
        model = reference.make_checkpoint(fam, root / name)
        prompts = reference.prompts(fam.config()["vocab_size"])
        total = sum(len(p) for p in prompts)
        feats = deepstack.embeds(total, fam.config()["text_config"]["hidden_size"])
        out[name] = dict(checkpoint=str(root / name), prompts=prompts, deepstack=feats,
                         ref=deepstack.reference(model, prompts, feats))
    return out


def _results(rank_pool, refs, name, tp, fusion, order, setting):
    if name not in refs:
        pytest.skip(f"{name}: not on this base")
    if tp not in _RUNS:
        names, cases = [], []
        for n, r in sorted(refs.items()):
            names.append(n)
            cases.append(dict(checkpoint=r["checkpoint"], prompts=r["prompts"],
                              deepstack=r["deepstack"],
                              fusions=list(families()[n].fusions(tp))))
        per_rank = _pool(rank_pool, tp).run("harness.parity.deepstack:run", cases)
        _RUNS[tp] = {}
        for r, rank_results in enumerate(per_rank):
            for n, results in zip(names, rank_results):
                for res in results:
                    key = (n, res["fusion"], res["order"], res["setting"])
                    _RUNS[tp].setdefault(key, []).append(res)
    per_rank = _RUNS[tp][(name, fusion, order, setting)]
    for r, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"{name} tp{tp} {fusion} {order} deepstack_capture={setting}: "
                        f"rank {r} raised:\n{res['error']}")
    return per_rank


def _close(got, want, what, rank, atol):
    scale = max(float(want.abs().max()), 1.0)
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    assert diff <= atol * scale, (
        f"rank {rank}: {what} differs from transformers: max abs diff {diff:.3g} "
        f"(|ref| max {scale:.3g}, shape {tuple(got.shape)} vs {tuple(want.shape)})")


@pytest.mark.parametrize("name, tp, fusion, order, setting", list(_params()))
def test_deepstack_captures_and_output(rank_pool, deepstack_refs, name, tp, fusion, order,
                                       setting):
    import torch

    fam = families()[name]
    per_rank = _results(rank_pool, deepstack_refs, name, tp, fusion, order, setting)
    ref = deepstack_refs[name]["ref"]
    feats = deepstack_refs[name]["deepstack"]
    L = ref["num_layers"]
    hidden = ref["final"].shape[-1]
    post = DEFAULT_POST[(_label(), order)] if setting is None else setting == "post_deepstack"
    side = "post_deepstack" if post else "pre_deepstack"
    for r, res in enumerate(per_rank):
        ltc = res["layers_to_capture"]
        assert ltc == list(range(1, L + 1)), f"rank {r}: captures requested {ltc}"
        aux = res["aux"]
        assert aux is not None and aux.shape[-1] == L * hidden, (
            f"rank {r}: captured {0 if aux is None else aux.shape[-1] // hidden} of {L}")
        for k, index in enumerate(ltc):
            what = (f"capture {k} (index {index}, {side}: "
                    + ("the stream entering the final norm)" if index == L else
                       f"transformers' hidden_states[{index}]"
                       + (f" + deepstack[{index - 1}])"
                          if post and index <= deepstack.DEEPSTACK_LAYERS else ")")))
            _close(aux[:, k * hidden:(k + 1) * hidden],
                   deepstack.expected(ref, feats, index, post), what, r, fam.atol)
        _close(res["final"], ref["final"], "final hidden states", r, fam.atol)
        alone_of = res.get("alone", {}) if name in BIT_EQUAL[_label()] else {}
        for index, alone in alone_of.items():
            k = ltc.index(index)
            got, want = (t[:, k * hidden:(k + 1) * hidden] for t in (aux, alone))
            assert torch.equal(got, want), (
                f"rank {r}: pre_deepstack capture {k} (index {index}) is not decoder layer "
                f"{index - 1}'s output bit for bit: max abs diff "
                f"{float((got - want).abs().max()):.3g} from the same capture with its "
                f"deepstack zero")


def test_reference_sides_differ(deepstack_refs):
    """The two settings' references are transformers' own tensors and far apart: the
    stream entering layer k (a pre-hook) is hidden_states[k] + deepstack[k - 1]."""
    import torch

    if not deepstack_refs:
        pytest.skip("no deepstack family selected on this base")
    for name, entry in deepstack_refs.items():
        ref, feats = entry["ref"], entry["deepstack"]
        for k in range(1, deepstack.DEEPSTACK_LAYERS + 1):
            pre = deepstack.expected(ref, feats, k, post=False)
            post = deepstack.expected(ref, feats, k, post=True)
            torch.testing.assert_close(post, ref["entering"][k], rtol=1e-5, atol=1e-5)
            assert float((post - pre).abs().max()) > 0.1, (name, k)
