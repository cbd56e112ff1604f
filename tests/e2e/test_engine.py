"""SGLang's own ``sglang.Engine`` on the CPU, target + draft, on the patched SGLang.

Per configuration (harness.e2e.cases): each prompt alone, then both batched, through one
Engine. The checks:

- ``test_spec_equals_plain``: speculative greedy output == plain greedy output of the same
  target and dtype, token for token, single and batched (exact and random drafts: every
  draft token accepted, and every one rejected);
- ``test_accept_length``: with the constructed draft, which predicts the anchored target
  exactly only from the target's *last* layer's output, every round accepts every draft
  token: accept length = draft length + 1 (4.0). A missing capture, an off-by-one layer
  or another value in that slot loses the acceptance (or, where the width no longer
  fits the draft's ``fc``, the engine);
- ``test_captures_reach_draft``: through the real ``set_eagle3_layers_to_capture`` /
  ``set_dflash_layers_to_capture`` that ``model_runner`` calls, the target hands over K
  of K captures at every forward and the draft's ``fc`` receives K*H-wide input;
- ``test_last_capture_side_of_the_final_norm``: the last capture is the final norm's
  output at every forward when the draft config says ``final_layer_capture:
  post_norm``, and never when it says nothing (``pre_norm``, the default);
- ``test_captures_equal_transformers``: at every target forward (extend and
  target-verify, single and batched), all K captures of every row equal transformers'
  hidden states on the tokens that row was computed on (``cases.capture_mismatches``):
  the targets' norm weights are perturbed, so a last capture without the residual, with
  it twice or on the wrong side of the final norm shows;
- ``test_plain_*``: the plain references themselves: single == batched, and (float32)
  == transformers' greedy output.

``ANCHOR`` gives two verify rounds, every draft token accepted; ``PARTIAL`` three, the
first rejected: its later rounds are drafted from the captures of verify forwards.
"""

from __future__ import annotations

import pytest

from harness.e2e import cases, checkpoints
from harness.e2e.cases import CASES, EXACT_CASES, GUARDS, PLAIN_CASES, SPEC_CASES, accept_length
from harness.e2e.engine import EngineError

pytestmark = [pytest.mark.e2e, pytest.mark.bases("0.5.13.post1", "0.5.23")]


def _ids(case) -> str:
    return case.key


def _run(e2e_runs, key: str):
    """The configuration's run; a skip, with SGLang's own words, where SGLang refuses the
    configuration on the CPU (0.5.23 refuses DFLASH on every device but cuda/npu/xpu)."""
    case = CASES[key]
    if case.reference_for:
        _run(e2e_runs, case.reference_for)  # a reference for nothing that runs is skipped
    try:
        return e2e_runs.get(key)
    except EngineError as exc:
        reason = cases.platform_refusal(exc)
        if reason is None:
            raise
        what = key if not case.reference_for else f"{key} (the plain reference of {case.reference_for})"
        pytest.skip(f"{what}: SGLang {e2e_runs.session.base} refuses it on the CPU: {reason} "
                    "(srt/arg_groups/speculative_hook.py _handle_dflash takes only cuda, npu and xpu)")


def _guarded(case_list):
    from harness.patchset.layout import layout

    base = layout().label
    return [pytest.param(c, id=c.key, marks=() if c.algorithm == "DFLASH" and base in cases.DFLASH_REFUSED
                         else pytest.mark.guards(GUARDS[c.model])) for c in case_list]


def _prompt_name(i: int) -> str:
    return "ANCHOR" if cases.PROMPTS[i] == cases.ANCHOR else "PARTIAL"


@pytest.mark.parametrize("case", PLAIN_CASES, ids=_ids)
def test_plain_single_equals_batched(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    assert run.ids("batched") == run.ids("single")
    # the anchored target's defining behaviour, as the engine computes it
    for i, prompt in enumerate(cases.PROMPTS):
        got = run.ids("single")[i]
        assert got == cases.expected_output(prompt), f"{case.key}: the anchored target gave {got} for {_prompt_name(i)}"


@pytest.mark.parametrize("case", [c for c in PLAIN_CASES if c.dtype == "float32"], ids=_ids)
def test_plain_matches_transformers(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    target = e2e_runs.ckpts.target(case.model)
    for i, prompt in enumerate(cases.PROMPTS):
        hf = checkpoints.hf_greedy(target, list(prompt), cases.MAX_NEW_TOKENS[prompt])
        assert run.ids("single")[i] == hf, f"{case.key} {_prompt_name(i)}: SGLang {run.ids('single')[i]} != HF {hf}"


@pytest.mark.parametrize("how", ["single", "batched"])
@pytest.mark.parametrize("case", SPEC_CASES, ids=_ids)
def test_spec_equals_plain(e2e_runs, case, how):
    plain = _run(e2e_runs, case.plain_key)
    spec = _run(e2e_runs, case.key)
    for i, (want, got) in enumerate(zip(plain.ids(how), spec.ids(how))):
        assert got == want, f"{case.key} ({how}, {_prompt_name(i)} prompt): speculative {got} != plain {want}"


@pytest.mark.parametrize("case", _guarded(EXACT_CASES))
def test_accept_length(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    # ANCHOR: every round accepts all; PARTIAL (EAGLE3's exact draft): the first round
    # none, the later ones all (DFlash's draft attends to the whole context: not asserted)
    expected = {cases.ANCHOR: case.accept_length}
    if case.algorithm == "EAGLE3":
        expected[cases.PARTIAL] = cases.EXACT_ACCEPT[cases.PARTIAL]
    if case.draft == "partial":  # right at each round's first step only: 1 of 3 accepted
        expected = dict(cases.PARTIAL_ACCEPT)
    for prompt, want in expected.items():
        i = cases.PROMPTS.index(prompt)
        for how, out in (("single", run.singles[i]), ("batched", run.batch[i])):
            meta = out["meta"]
            got = accept_length(meta)
            assert got == want, (
                f"{case.key} ({how}, {_prompt_name(i)}): accept length {got} (accepted "
                f"{meta.get('spec_num_correct_drafts')} of {meta.get('spec_num_proposed_drafts')} draft tokens "
                f"in {meta.get('spec_verify_ct')} rounds), expected {want}: the draft did not see the target's "
                "last-layer output"
            )
            assert out["output_ids"] == cases.expected_output(prompt)


@pytest.mark.parametrize("case", _guarded(SPEC_CASES))
def test_captures_reach_draft(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    k, hidden = len(case.aux_ids), checkpoints.H
    setter = "set_dflash_layers_to_capture" if case.algorithm == "DFLASH" else "set_eagle3_layers_to_capture"
    sets = [e for e in run.events if e["event"] == "set_layers"]
    assert [e["setter"] for e in sets] == [setter], f"{case.key}: setters called: {sets}"
    assert sets[0]["layer_ids"] == list(case.aux_ids)
    layers = e2e_runs.ckpts.target(case.model).layers
    assert layers in sets[0]["layers_to_capture"], (
        f"{case.key}: layers_to_capture {sets[0]['layers_to_capture']} does not name the last layer's output ({layers})"
    )
    aux = [e for e in run.events if e["event"] == "aux" and e["target"]]
    assert aux, f"{case.key}: the target never handed over aux hidden states"
    short = [e for e in aux if e["k"] != k]
    assert not short, f"{case.key}: the target handed over {sorted({e['k'] for e in short})} of {k} captures"
    fc = [e for e in run.events if e["event"] == "fc"]
    assert fc, f"{case.key}: the draft's fc never ran (the captures it got were already {hidden} wide)"
    assert all(e["expected"] == k * hidden for e in fc), f"{case.key}: the draft's fc takes {fc[0]['expected']}"
    wide = [e["in"] for e in fc if e["in"] != hidden]
    assert wide and set(wide) == {k * hidden}, f"{case.key}: the draft's fc received widths {sorted(set(wide))}, expected {k * hidden}"


def _final_layer_guarded(case_list, also=None):
    """The post_norm cases guard the patch that reads the setting; a pre_norm case holds
    on a tree without it too (its last capture was never the norm's output). ``also``:
    the cases' other guards (``_guarded``), for every algorithm."""
    out = []
    for c in case_list:
        if also is None and c.algorithm != "EAGLE3":
            continue
        marks = list(also([c])[0].marks) if also is not None else []
        if c.final_layer_capture == "post_norm":
            marks.append(pytest.mark.guards(cases.FINAL_LAYER_CAPTURE))
        out.append(pytest.param(c, id=c.key, marks=marks))
    return out


@pytest.mark.parametrize("case", _final_layer_guarded(SPEC_CASES))
def test_last_capture_side_of_the_final_norm(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    post_norm = case.final_layer_capture == "post_norm"
    aux = [e for e in run.events if e["event"] == "aux" and e["target"] and e["tokens"]]
    assert aux, f"{case.key}: the target never handed over aux hidden states"
    wrong = [e for e in aux if e["last_is_final"] != post_norm]
    assert not wrong, (
        f"{case.key}: in {len(wrong)} of {len(aux)} target forwards the last capture "
        f"{'is not' if post_norm else 'is'} the final norm's output; the draft config asks for "
        f"{case.final_layer_capture or 'nothing (pre_norm)'}"
    )


@pytest.mark.parametrize("case", _final_layer_guarded(SPEC_CASES, also=_guarded))
def test_captures_equal_transformers(e2e_runs, case):
    run = _run(e2e_runs, case.key)
    checked, problems = cases.capture_mismatches(run, e2e_runs.ckpts)
    verify = [e for e in run.events if e["event"] == "captures" and e["mode"] == "TARGET_VERIFY"]
    assert checked and len(verify) >= 2, (
        f"{case.key}: {checked} capture rows checked, {len(verify)} target-verify forwards recorded")
    assert not problems, f"{case.key}: {len(problems)} forwards differ from transformers:\n" + "\n".join(problems[:8])
