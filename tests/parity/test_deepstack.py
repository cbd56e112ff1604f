"""Qwen3-VL deepstack against transformers, at TP 1 and 2 (FlashInfer fusion emulated
where the layers defer).

Every token is an image token with deepstack features for layers 0-2
(:mod:`harness.parity.deepstack`). SGLang's language models (dense ``Qwen3LLMModel``,
MoE ``Qwen3MoeLLMModel``), loaded from a tiny transformers checkpoint through SGLang's
own loader with every layer captured through the model runner's setup function, must
match transformers' language model:

* every capture of index ``i < L`` equals the stream entering transformers' layer ``i``
  (deepstack of layer ``i - 1`` included), the one of index ``L`` the stream entering
  the final norm; dense and MoE capture the same thing;
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


def _family(name):
    return deepstack.family(families()[name])


def _active(fam) -> bool:
    from harness.patchset.layout import layout

    return layout().label in fam.bases


def _guards(name: str, tp: int, fusion: str) -> list:
    """Bug "V" of the survey: dense qwen3_vl captured before deepstack at every TP;
    qwen3_vl_moe lost it where a layer deferred its all-reduce (TP > 1, fused)."""
    from harness.standins.models import specs

    spec = specs().get(name)
    if spec is None or "V" not in spec.bugs() or spec.patch_for("V") is None:
        return []
    if name == "qwen3_vl_moe" and not (tp > 1 and fusion != "off"):
        return []
    return [pytest.mark.guards(spec.patch_for("V"))]


def _params():
    for name in FAMILIES:
        fam = families().get(name)
        if fam is None:
            continue
        for tp in TPS:
            for fusion in fam.fusions(tp):
                marks = [pytest.mark.multirank, pytest.mark.world_size(tp)] + _guards(name, tp, fusion)
                yield pytest.param(name, tp, fusion, id=f"{name}-tp{tp}-{fusion}", marks=marks)


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


def _results(rank_pool, refs, name, tp, fusion):
    if name not in refs:
        pytest.skip(f"{name}: not on this base")
    if tp not in _RUNS:
        keys, cases = [], []
        for n, r in sorted(refs.items()):
            fusions = list(families()[n].fusions(tp))
            keys.append((n, fusions))
            cases.append(dict(checkpoint=r["checkpoint"], prompts=r["prompts"],
                              deepstack=r["deepstack"], fusions=fusions))
        per_rank = _pool(rank_pool, tp).run("harness.parity.deepstack:run", cases)
        _RUNS[tp] = {(n, f): [rr[i][j] for rr in per_rank]
                     for i, (n, fusions) in enumerate(keys) for j, f in enumerate(fusions)}
    per_rank = _RUNS[tp][(name, fusion)]
    for r, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"{name} tp{tp} {fusion}: rank {r} raised:\n{res['error']}")
    return per_rank


def _close(got, want, what, rank, atol):
    scale = max(float(want.abs().max()), 1.0)
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    assert diff <= atol * scale, (
        f"rank {rank}: {what} differs from transformers: max abs diff {diff:.3g} "
        f"(|ref| max {scale:.3g}, shape {tuple(got.shape)} vs {tuple(want.shape)})")


@pytest.mark.parametrize("name, tp, fusion", list(_params()))
def test_deepstack_captures_and_output(rank_pool, deepstack_refs, name, tp, fusion):
    fam = families()[name]
    ref = deepstack_refs[name]["ref"] if name in deepstack_refs else None
    per_rank = _results(rank_pool, deepstack_refs, name, tp, fusion)
    L = ref["num_layers"]
    hidden = ref["final"].shape[-1]
    for r, res in enumerate(per_rank):
        ltc = res["layers_to_capture"]
        assert ltc == list(range(1, L + 1)), f"rank {r}: captures requested {ltc}"
        aux = res["aux"]
        assert aux is not None and aux.shape[-1] == L * hidden, (
            f"rank {r}: captured {0 if aux is None else aux.shape[-1] // hidden} of {L}")
        for k, index in enumerate(ltc):
            want = ref["entering"][index] if index < L else ref["pre_norm"]
            _close(aux[:, k * hidden:(k + 1) * hidden], want,
                   f"capture {k} (the stream entering layer {index})", r, fam.atol)
        _close(res["final"], ref["final"], "final hidden states", r, fam.atol)
