"""Exact peak bytes of the capture path on CPU (patch aux-packer).

list + cat holds the K captures and their concatenation at once: peak = 2 x K x T x
H x itemsize over baseline. The packer writes each capture into the packed buffer:
peak = 1 x.
"""

from __future__ import annotations

import pytest

from harness.memory.capture import capture_path

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")

GUARD = pytest.mark.guards("aux-packer")


def _device():
    from harness.standins.kernels import device

    return device()


def _same(got, want, allocs):
    """Exact on CPU; the CUDA caching allocator rounds each block up to 512 B."""
    if _device() == "cpu":
        return got == want
    return want <= got <= want + 512 * allocs


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_list_and_cat_peaks_at_twice_the_captures(sglang_tp1, tokens, k):
    res = capture_path("list", tokens, 32, k, "float32", _device())
    s = res["capture_bytes"]
    assert _same(res["peak_bytes"], 2 * s, 2 * k), res
    assert _same(res["held_after_bytes"], s, 1), res


@GUARD
@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packer_peaks_at_the_captures(sglang_tp1, tokens, k, dtype):
    res = capture_path("packer", tokens, 32, k, dtype, _device())
    s = res["capture_bytes"]
    assert _same(res["peak_bytes"], s, 1), (
        f"packer peak {res['peak_bytes']} B, expected {s} B (1 x K x T x H x itemsize)"
    )
    assert _same(res["held_after_bytes"], s, 1)
    assert res["copied_bytes"] == s, "the packer copies each capture exactly once"


@GUARD
def test_packer_halves_the_peak(sglang_tp1):
    lst = capture_path("list", 128, 64, 3, "bfloat16", _device())
    pk = capture_path("packer", 128, 64, 3, "bfloat16", _device())
    assert _same(pk["peak_bytes"] * 2, lst["peak_bytes"], 6)
    assert pk["copied_bytes"] * 2 == lst["copied_bytes"]


def test_zero_tokens_allocates_nothing(sglang_tp1):
    for path in ("list",):
        res = capture_path(path, 0, 32, 3, "float32", _device())
        assert res["peak_bytes"] == 0


MODEL_GUARD = pytest.mark.guards("models-aux-packer")


@MODEL_GUARD
@pytest.mark.parametrize("tokens", [1, 96])
def test_list_capturing_model_family_goes_from_twice_to_once(sglang_tp1, tokens):
    """The pin's LlamaModel (list + cat) against the patched one (packed), same process:
    the capture path peaks at 2x and 1x K*T*H*itemsize."""
    from harness.memory.models import model_capture_peaks

    res = model_capture_peaks("llama", tokens, 64, [2, 4, 5], "float32", _device())
    s = res["capture_bytes"]
    assert _same(res["pin"]["capture_path_peak_bytes"], 2 * s, 6), res
    assert _same(res["patched"]["capture_path_peak_bytes"], s, 1), res
