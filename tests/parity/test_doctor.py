"""The convention doctor on the demo's planted checkpoints (``harness.doctor.cases``).

For each case of the active base whose features come from the transformers trainer
path (the Engine-made ones run in ``make e2e``, ``tests/e2e/test_doctor.py``): a tiny
target, a draft and a features file with one planted convention (ids in SGLang's or
vLLM's meaning, the last layer before or after the final norm, Qwen3-VL's deepstack
before or after its addition, Gemma3 with or without the residual, a norm tensor no
key turns on). The doctor must detect the planted convention, give the verdict this
base's server earns (Qwen3-VL's default side differs by base), and name a fix for every
mismatch, verified by serving it through SGLang's own resolver and setters.

The served mapping runs in the parity tier's TP 1 pool (SGLang's real models), the
features come from transformers (``output_hidden_states``), so both sides are outside
the doctor's own term code.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.doctor import cases, diagnose
from harness.parity.runner import ENV, INIT_FN, PRELOAD

pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), pytest.mark.parity]


def _label() -> str:
    from harness.patchset.layout import layout

    return layout().label


def _cases() -> list:
    return [c for c in cases.CASES if c.source == "transformers"]


@pytest.fixture(scope="module")
def doctor_env(rank_pool, tmp_path_factory):
    """The parity pool (SGLang in CPU engine mode), a work directory with its shrunk
    checkpoints, and the demo's targets (one per family)."""
    pool = rank_pool(1, backend="gloo", init_fn=INIT_FN, env=dict(ENV), timeout=1200,
                     start_timeout=900, preload=PRELOAD)
    root = tmp_path_factory.mktemp("doctor")
    return {"pool": pool, "root": root, "shrunk": diagnose.Shrunk(root / "work"), "targets": {},
            "reports": {}}


def _report(env, case):
    from harness.doctor.demo import build

    if case.name not in env["reports"]:
        target, draft, features = build(case, env["root"], env["targets"])
        env["reports"][case.name] = (target, draft, features, diagnose.diagnose(
            target, draft, features, diagnose.Options(quiet=True), env["pool"], env["shrunk"], _label()))
    return env["reports"][case.name]


@pytest.mark.parametrize("name", [c.name for c in _cases()])
def test_planted_convention_detected_and_fixed(doctor_env, name):
    case = next(c for c in _cases() if c.name == name)
    *_, report = _report(doctor_env, case)
    entry = cases.summary(case, report, _label())
    assert entry["ok"], f"{name}: {entry['problems']} (report conventions {report.conventions}, " \
                        f"slots {[s.to_json(report.target.layers) for s in report.slots]})"


@pytest.mark.parametrize("name", [c.name for c in _cases()])
def test_every_slot_is_one_term_unambiguously(doctor_env, name):
    """Each slot of the features and of the served captures is one of transformers' terms
    (float32: error at rounding level) and every other term is far (so a wrong value
    would be seen), except where the case plants a value the server cannot give."""
    case = next(c for c in _cases() if c.name == name)
    *_, report = _report(doctor_env, case)
    for slot in report.slots:
        for what, m in (("trained", slot.trained), ("served", slot.serves)):
            assert m is not None and m.term is not None, f"slot {slot.slot}: {what} {m}"
            assert m.error < 1e-4, f"slot {slot.slot}: {what} {m.term.key()} error {m.error}"
            assert m.runner_up_error > 0.05, (
                f"slot {slot.slot}: {what} runner-up {m.runner_up.key()} within {m.runner_up_error}")


def test_ids_fix_serves_the_trained_layers(doctor_env):
    """vLLM's meaning (id k = hidden_states[k]) served by SGLang (hidden_states[k + 1]):
    the fix is the draft's ids less one, and serving them gives every slot its trained
    layer."""
    case = next(c for c in _cases() if c.name == "llama-ids-vllm")
    *_, report = _report(doctor_env, case)
    assert [s.serves.term.key() for s in report.slots] == [f"hidden_states[{i + 1}]" for i in case.ids]
    assert [s.trained.term.key() for s in report.slots] == [f"hidden_states[{i}]" for i in case.ids]
    assert report.change["draft_config"] == {
        "eagle_config.eagle_aux_hidden_state_layer_ids": [i - 1 for i in case.ids]}
    assert report.change["verified"]
    assert report.change["serves_then"] == [f"hidden_states[{i}]" for i in case.ids]


def test_features_from_other_weights_are_no_term(doctor_env, tmp_path):
    """Features that are no transformers term of the target (the planted ones, scaled by
    1.1 in one slot) are a mismatch with no ids or setting proposed for that slot."""
    import torch

    case = next(c for c in _cases() if c.name == "llama-ids-sglang")
    target, draft, features, _ = _report(doctor_env, case)
    data = torch.load(features, weights_only=True)
    h = data["aux_hidden_state"].shape[-1] // len(case.ids)
    data["aux_hidden_state"][..., h:2 * h] *= 1.1
    other = tmp_path / "features.pt"
    torch.save(data, other)
    report = diagnose.diagnose(target, draft, other, diagnose.Options(quiet=True), doctor_env["pool"],
                               doctor_env["shrunk"], _label())
    verdicts = [s.verdict for s in report.slots]
    assert verdicts == ["match", "mismatch", "match"], verdicts
    assert report.slots[1].trained.term is None
    assert "other weights" in report.slots[1].why
    assert report.slots[1].fix.startswith("none: check that FEATURES")


def test_speculators_top_level_ids_are_not_what_sglang_serves(doctor_env, tmp_path):
    """vllm-project/vllm#50170: a speculators-format draft names its ids at the top level,
    which SGLang's model runner does not read; it falls back to EAGLE3's default ids,
    ``[2, 3, 3]`` on these 6 layers, which it refuses (a layer twice). The doctor says
    both, and its fix (the ids in eagle_config) is verified by serving it."""
    import json

    case = next(c for c in _cases() if c.name == "llama-ids-sglang")
    target, draft, features, _ = _report(doctor_env, case)
    moved = tmp_path / "draft"
    moved.mkdir()
    config = json.loads((draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    (moved / "config.json").write_text(json.dumps(config))
    (moved / "model.safetensors").symlink_to(draft / "model.safetensors")
    report = diagnose.diagnose(target, moved, features, diagnose.Options(quiet=True), doctor_env["pool"],
                               doctor_env["shrunk"], _label())
    assert "[2, 3, 3]" in report.served.refused
    assert any("top level" in f.what for f in report.findings)
    assert report.verdict == "refused"
    assert report.change["verified"]
    assert report.change["draft_config"] == {"eagle_config.eagle_aux_hidden_state_layer_ids": list(case.ids)}


def test_server_flag_is_what_the_server_resolves(doctor_env):
    """The doctor passes its server flags to SGLang's own resolution: with
    ``--speculative-final-layer-capture post_norm`` the post_norm features match, and an
    unknown value is SGLang's own refusal, named on one line."""
    case = next(c for c in _cases() if c.name == "llama-last-post-norm")
    target, draft, features, _ = _report(doctor_env, case)
    report = diagnose.diagnose(target, draft, features,
                               dataclasses.replace(diagnose.Options(quiet=True), final_layer_capture="post_norm"),
                               doctor_env["pool"], doctor_env["shrunk"], _label())
    assert report.verdict == "match", [s.to_json(6) for s in report.slots]
    bad = diagnose.diagnose(target, draft, features,
                            dataclasses.replace(diagnose.Options(quiet=True), final_layer_capture="after_norm"),
                            doctor_env["pool"], doctor_env["shrunk"], _label())
    assert bad.verdict == "refused"
    assert "--speculative-final-layer-capture" in bad.served.refused and "\n" not in bad.served.refused
