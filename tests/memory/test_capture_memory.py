"""Exact peak bytes of the capture path on CPU (patch aux-packer).

list + cat holds the K captures and their concatenation at once: peak = 2 x K x T x
H x itemsize over baseline. The packer writes each capture into the packed buffer:
peak = 1 x.
"""

from __future__ import annotations

import pytest

from harness.suites.memory import capture_path

GUARD = pytest.mark.guards("aux-packer")


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_list_and_cat_peaks_at_twice_the_captures(sglang_tp1, tokens, k):
    res = capture_path("list", tokens, 32, k, "float32")
    s = res["capture_bytes"]
    assert res["peak_bytes"] == 2 * s, res
    assert res["held_after_bytes"] == s, res


@GUARD
@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packer_peaks_at_the_captures(sglang_tp1, tokens, k, dtype):
    res = capture_path("packer", tokens, 32, k, dtype)
    s = res["capture_bytes"]
    assert res["peak_bytes"] == s, (
        f"packer peak {res['peak_bytes']} B, expected {s} B (1 x K x T x H x itemsize)"
    )
    assert res["held_after_bytes"] == s
    assert res["copied_bytes"] == s, "the packer copies each capture exactly once"


@GUARD
def test_packer_halves_the_peak(sglang_tp1):
    lst = capture_path("list", 128, 64, 3, "bfloat16")
    pk = capture_path("packer", 128, 64, 3, "bfloat16")
    assert pk["peak_bytes"] * 2 == lst["peak_bytes"]
    assert pk["copied_bytes"] * 2 == lst["copied_bytes"]


def test_zero_tokens_allocates_nothing(sglang_tp1):
    for path in ("list",):
        res = capture_path(path, 0, 32, 3)
        assert res["peak_bytes"] == 0
