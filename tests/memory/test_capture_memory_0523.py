"""Exact peak bytes of LlamaModel's capture path on 0.5.23 (patch llama-aux-packer).

The pristine 0.5.23 ``llama.py`` (read from the verified release wheel, loaded under a
module name of its own) against the patched one, each a tiny real ``LlamaModel`` with
CPU stand-ins, side by side in one process: list + cat holds the K captures and their
concatenation at once (2 x K*T*H*itemsize), the packer one packed buffer (1 x).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.bases("0.5.23"), pytest.mark.guards("llama-aux-packer")]


def _same(got, want, allocs):
    """Exact on CPU; the CUDA caching allocator rounds each block up to 512 B."""
    from harness.standins.kernels import device

    if device() == "cpu":
        return got == want
    return want <= got <= want + 512 * allocs


@pytest.mark.parametrize("tokens", [1, 96])
def test_llama_goes_from_twice_to_once_the_captures(sglang_tp1, tokens):
    from harness.memory.models import model_capture_peaks
    from harness.standins.kernels import device
    from harness.standins.models import specs

    # The 0.5.23 stand-ins are built at the spec's own width. Layers below the last:
    # pristine 0.5.23 never captures the last layer.
    hidden = specs()["llama"].tiny.hidden_size
    res = model_capture_peaks("llama", tokens, hidden, [2, 4, 5], "float32", device())
    s = res["capture_bytes"]
    assert _same(res["pin"]["capture_path_peak_bytes"], 2 * s, 6), res
    assert _same(res["patched"]["capture_path_peak_bytes"], s, 1), res
