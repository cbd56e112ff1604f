"""Captures under ``--rl-on-policy-target`` (``harness.parity.rl_on_policy``): bfloat16
weights, a float32 residual stream and final norm (Qwen3).

A capture is the layer's complete output, ``hidden_states + residual``: float32 when
the residual is, as the unpatched list of captures held it (and ``torch.cat`` kept it);
the final norm's output, a ``post_norm`` capture, is float32 too. The packed buffer must
hold them in float32 in both final-layer settings: packing must not round a float32
stream to the first capture's bfloat16 (``pre_norm``), nor refuse the float32 norm
output (``post_norm``). Checked against transformers' float32 reference within what
bfloat16 projections allow, and the ``post_norm`` capture against the final hidden
states the logits processor got, exactly.
"""

from __future__ import annotations

import pytest
import torch

from harness.parity import reference
from harness.parity.families import families
from harness.parity.runner import ENV, INIT_FN, PRELOAD

pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), pytest.mark.parity]

# Qwen3 only: Qwen2ForCausalLM under the setting feeds its float32 embedding stream into
# its bfloat16 qkv_proj (pin qwen2.py:195, Qwen2Attention.forward: "mat1 and mat2 must
# have the same dtype"), on any device; Qwen3Attention casts it first.
FAMILIES = ("qwen3",)
SETTINGS = ("pre_norm", "post_norm")
# bfloat16 projections against transformers in float32: a few bfloat16 ulps of the
# stream's scale after 4 layers.
ATOL = 5e-2


def _marks() -> list:
    """The pin's capture-dtype-promoted fixes this; 0.5.23's layer boundary captures the
    float32 residual stream itself (no patch: a regression check there)."""
    from harness.patchset.layout import layout

    return ([pytest.mark.guards("capture-dtype-promoted")]
            if layout().label == "0.5.13.post1" else [])


def _request(setting: str, num_layers: int) -> dict:
    # EAGLE3 ids with the last layer: every in-loop capture and the last one.
    return {"eagle3": list(range(num_layers)), "final_layer_capture": setting}


_RUNS: dict = {}


@pytest.fixture(scope="module")
def rl_refs(selected_cases, rank_pool, tmp_path_factory):
    wanted = selected_cases("test_rl_on_policy_captures.py")
    if wanted:
        rank_pool(1, backend="gloo", init_fn=INIT_FN, env=dict(ENV), timeout=1200,
                  start_timeout=900, wait=False, preload=PRELOAD)
    root = tmp_path_factory.mktemp("rl_on_policy")
    out = {}
    for name in FAMILIES:
        if name not in wanted:
            continue
        fam = families()[name]
        model = reference.make_checkpoint(fam, root / name)
        prompts = reference.prompts(fam.config()["vocab_size"])
        out[name] = dict(checkpoint=str(root / name), prompts=prompts,
                         ref=reference.reference(fam, model, prompts,
                                                 reference.appended_tokens(
                                                     fam.config()["vocab_size"])))
    return out


def _results(rank_pool, refs, name, setting):
    if not _RUNS:
        cases = [dict(checkpoint=r["checkpoint"], prompts=r["prompts"],
                      requests=[_request(s, r["ref"]["num_layers"]) for s in SETTINGS])
                 for r in refs.values()]
        pool = rank_pool(1, backend="gloo", init_fn=INIT_FN, env=dict(ENV), timeout=1200,
                         start_timeout=900, preload=PRELOAD)
        (per_case,) = pool.run("harness.parity.rl_on_policy:run", cases)
        for n, results in zip(refs, per_case):
            for s, res in zip(SETTINGS, results):
                _RUNS[(n, s)] = res
    res = _RUNS[(name, setting)]
    if "error" in res:
        pytest.fail(f"{name} rl_on_policy_target {setting}: raised:\n{res['error']}")
    return res


def _params():
    for name in FAMILIES:
        for setting in SETTINGS:
            yield pytest.param(name, 1, setting, id=f"{name}-{setting}",
                               marks=[pytest.mark.multirank, pytest.mark.world_size(1), *_marks()])


@pytest.mark.parametrize("name, tp, setting", list(_params()))
def test_captures_keep_the_float32_stream(rank_pool, rl_refs, name, tp, setting):
    res = _results(rank_pool, rl_refs, name, setting)
    ref = rl_refs[name]["ref"]
    L = ref["num_layers"]
    hidden = ref["final"].shape[-1]
    aux = res["aux"]
    assert aux is not None and aux.shape[-1] == L * hidden, "not K of K captures"
    assert aux.dtype == torch.float32, (
        f"the packed captures are {aux.dtype}: the float32 stream was rounded "
        "(hidden_states + residual is float32 under rl_on_policy_target)")
    for k, index in enumerate(res["layers_to_capture"]):
        got = aux[:, k * hidden:(k + 1) * hidden]
        want = (ref["hidden_states"][index] if index < L else
                ref["pre_norm"] if setting == "pre_norm" else ref["final"])
        diff = float((got - want).abs().max())
        assert diff <= ATOL * max(float(want.abs().max()), 1.0), (
            f"capture {k} (index {index}) differs from transformers by {diff:.3g}")
    if setting == "post_norm":
        last = aux[:, -hidden:]
        assert torch.equal(last, res["final"].to(last.dtype)), (
            "the post_norm capture is not the final hidden states the logits processor got")
