"""The bundles' GPU checks (harness/suites/acceptance.py): every bundle pr-export writes
has one or a reason why none runs on one GPU; a bundle's body prints the command lines
the check runs; on this machine (no GPU) the check prepares what it can and stops with
one line; what it compares (acceptance length, rows) decides as stated."""

from __future__ import annotations

import pytest

from harness import HarnessError
from harness.suites import acceptance


def _units():
    from harness.patchset.layout import layout
    from harness.upstream import bundles
    from harness.upstream.prexport import TEMPLATES
    from harness.upstream.status import load_series

    lay = layout(base="0.5.23")
    return lay, bundles.load(TEMPLATES / lay.base, load_series(lay))


def test_every_bundle_has_a_gpu_check_or_a_reason():
    _, units = _units()
    ids = {u.id for u in units}
    assert ids == set(acceptance.BUNDLE_CHECKS), (
        f"no entry: {sorted(ids - set(acceptance.BUNDLE_CHECKS))}; "
        f"stale: {sorted(set(acceptance.BUNDLE_CHECKS) - ids)}")
    for bundle, entry in acceptance.BUNDLE_CHECKS.items():
        if isinstance(entry, tuple):
            assert entry and all(n in acceptance.CHECKS for n in entry), bundle
        else:
            assert entry.strip(), bundle


def test_a_bundles_body_prints_the_commands_the_check_runs():
    from harness.upstream.prbody import fork_markers

    lines = "\n".join(acceptance.body_lines("aux-hidden-state-list-deprecated", "0.5.23"))
    check = acceptance.CHECKS["llama-eagle3"]
    assert " ".join(check.launch()) in lines
    assert "--speculative-draft-model-path lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge" in lines
    assert "sglang.bench_serving" in lines and "get_server_info" in lines
    assert fork_markers(lines) == []
    reason = "\n".join(acceptance.body_lines("capture-ids-checked", "0.5.23"))
    assert reason.startswith("GPU check: none on one GPU (")


def test_without_a_gpu_the_check_stops_in_one_line_after_preparing(monkeypatch):
    from harness.patchset.layout import layout

    monkeypatch.setattr(acceptance, "_gpu_count", lambda: 0)
    lay = layout(base="0.5.23")
    if not (lay.tree / ".git").exists():
        pytest.skip("build/sglang-0.5.23 not applied")
    with pytest.raises(HarnessError) as e:
        acceptance.run_checks(lay, ["qwen3-dflash"])
    msg = str(e.value)
    assert "\n" not in msg and "needs a CUDA device" in msg and "Qwen/Qwen3-8B" in msg
    assert "python3 -m sglang.launch_server --model-path Qwen/Qwen3-8B" in (
        lay.results / "gpu-acceptance" / "commands.txt").read_text()
    with pytest.raises(HarnessError, match="unknown GPU check"):
        acceptance.run_checks(lay, ["no-such-check"])


def test_acceptance_length_unchanged_within_tolerance_and_rows_identical():
    draft = acceptance.CHECKS["llama-eagle3"]
    ok, line = acceptance.verdict(draft, {"accept_length": 3.00}, {"accept_length": 3.05})
    assert ok and "unchanged" in line
    ok, line = acceptance.verdict(draft, {"accept_length": 3.00}, {"accept_length": 2.80})
    assert not ok and "CHANGED" in line
    assert not acceptance.verdict(draft, {"accept_length": None}, {"accept_length": 3.0})[0]
    aux = acceptance.CHECKS["llama-return-aux"]
    rows = [[0.5, 1.0], [2.0, -1.0]]
    same = {"rows": 2, "digest": acceptance.features_digest(rows), "rows_per_s": 10.0}
    other = dict(same, digest=acceptance.features_digest([[0.5, 1.0], [2.0, -1.5]]))
    assert acceptance.verdict(aux, same, dict(same))[0]
    assert not acceptance.verdict(aux, same, other)[0]
