"""The convention doctor on features that SGLang's own Engine made (0.5.23's
``--enable-return-aux-hidden-states``, the trainer's path of sgl-project/SpecForge#641).

The demo's engine case ``llama-last-post-norm-engine`` (``harness.doctor.cases``; the
other two engine cases run in ``make doctor-demo BASE=0.5.23``): a tiny llama target of 6
layers, the patched Engine returning the prompt rows of DFlash ids ``[1, 3, 5]`` (the last
layer's) served with ``--speculative-final-layer-capture post_norm``, a draft without the
key. The doctor must recover the convention from the Engine's rows (ids meaning each
layer's output, the last slot after the final norm) and name the draft config key (or
server flag) that makes training and serving agree, verified by serving it.
"""

from __future__ import annotations

import pytest

from harness.doctor import cases, diagnose

pytestmark = [pytest.mark.e2e, pytest.mark.bases("0.5.23")]

# In make e2e the one engine case that needs a fix (the others run in make doctor-demo
# BASE=0.5.23): its features are the patched Engine's with --speculative-final-layer-capture
# post_norm, served to a draft without the key.
ENGINE_CASES = [c for c in cases.CASES if c.source == "engine" and c.name == "llama-last-post-norm-engine"]


@pytest.fixture(scope="module")
def doctor_reports(e2e_runs, tmp_path_factory):
    from harness.doctor.demo import build
    from harness.patchset.layout import layout

    root = tmp_path_factory.mktemp("doctor")
    pool = diagnose.open_pool()
    shrunk, targets, out = diagnose.Shrunk(root / "work"), {}, {}
    for case in ENGINE_CASES:
        target, draft, features = build(case, root, targets, e2e_runs.session)
        out[case.name] = diagnose.diagnose(target, draft, features, diagnose.Options(quiet=True), pool,
                                           shrunk, layout().label)
    return out


@pytest.mark.parametrize("name", [c.name for c in ENGINE_CASES])
def test_engine_features_convention_recovered(doctor_reports, name):
    from harness.patchset.layout import layout

    case = next(c for c in ENGINE_CASES if c.name == name)
    report = doctor_reports[name]
    entry = cases.summary(case, report, layout().label)
    assert entry["ok"], f"{name}: {entry['problems']} (conventions {report.conventions})"
    for slot in report.slots:   # the Engine's rows are transformers' terms, float32 rounding apart
        assert slot.trained.term is not None and slot.trained.error < 1e-4, slot.to_json(6)
        assert slot.trained.runner_up_error > 0.05, slot.to_json(6)


def test_post_norm_engine_features_fix_is_the_setting(doctor_reports):
    report = doctor_reports["llama-last-post-norm-engine"]
    assert report.change["verified"], report.change
    assert report.change["draft_config"] == {"dflash_config.final_layer_capture": "post_norm"}
    assert report.change["or"]["server_flags"] == {"--speculative-final-layer-capture": "post_norm"}
