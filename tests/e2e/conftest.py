"""The real-engine tier's fixtures: one driver session (one Engine at a time) for the
whole pytest session, the checkpoints made once in a temp dir, and a timing summary.

Selected only with ``--e2e`` (``make e2e``; tests/conftest.py deselects them otherwise).
"""

from __future__ import annotations

import json
import os
import time

import pytest

_TIMINGS: list[tuple[str, str, float]] = []


def base_label() -> str:
    from harness.patchset.layout import layout

    label = layout().label
    tree = os.environ.get("HARNESS_SGLANG_PATH")
    return f"{label} (tree {tree})" if tree else label


@pytest.fixture(scope="session")
def e2e_runs(tmp_path_factory):
    """``Runs`` over one driver session; the session's processes are killed at the end,
    whatever happened."""
    from harness.e2e.cases import Checkpoints, Runs
    from harness.e2e.engine import Session

    root = tmp_path_factory.mktemp("e2e")
    session = Session(root / "engine", base=base_label())
    t0 = time.monotonic()
    try:
        yield Runs(session, Checkpoints(root / "checkpoints"))
    finally:
        session.close()
        _TIMINGS.extend(session.timings)
        _TIMINGS.append(("session", "total", time.monotonic() - t0))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TIMINGS:
        return
    tr = terminalreporter
    tr.section("e2e engine timings (s)")
    for key, what, secs in _TIMINGS:
        tr.write_line(f"{key:28s} {what:9s} {secs:7.1f}")
    out = os.environ.get("HARNESS_E2E_TIMINGS")
    if out:
        with open(out, "w") as f:
            json.dump([{"key": k, "what": w, "seconds": round(s, 2)} for k, w, s in _TIMINGS], f, indent=1)


@pytest.fixture(scope="session")
def feature_runs(e2e_runs, tmp_path_factory):
    """The return-aux tier's runs (``harness.e2e.features``), through the same driver
    session as the speculative configurations."""
    from harness.e2e.features import FeatureRuns

    return FeatureRuns(e2e_runs.session, tmp_path_factory.mktemp("features"))
