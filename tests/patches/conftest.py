"""TP = 1 tests on the patched SGLang build, in-process in the pytest worker."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sglang_tp1():
    """SGLang's own distributed state at world size 1 (gloo), once per worker."""
    from harness.sglang_dist import init_sglang_distributed

    return init_sglang_distributed(rank=0, world_size=1)


@pytest.fixture(scope="session")
def tiny_model(sglang_tp1):
    from harness.suites.capture import get_model

    return get_model()
