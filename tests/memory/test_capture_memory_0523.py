"""Exact peak bytes of each migrated family's capture path on 0.5.23 (the *-aux-packer
patches; each model's is its spec's fix for B).

The pristine 0.5.23 model file (read from the verified release wheel, loaded under a
module name of its own) against the patched one, each a tiny real model with CPU
stand-ins, side by side in one process: list + cat holds the K captures and their
concatenation at once (2 x K*T*H*itemsize), the packer one packed buffer (1 x). One
case per file that defines the forward: Qwen3MoeModel runs Qwen2MoeModel's, and a
pristine qwen3_moe.py would import the patched one.
"""

from __future__ import annotations

import pytest

from harness.standins.models import specs

pytestmark = pytest.mark.bases("0.5.23")

# Each guards the spec's own fix for B (its family's packer patch).
FORWARDS = [
    pytest.param(name, marks=pytest.mark.guards(specs()[name].patch_for("B")))
    for name in ("llama", "qwen2", "qwen3", "qwen2_moe", "gpt_oss", "glm4", "glm4_moe",
                 "glm4_moe_lite", "minimax_m2", "apertus", "arcee", "llama4", "exaone_moe",
                 "longcat_flash", "bailing_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_next",
                 "qwen3_5", "gemma4", "granitemoehybrid", "laguna", "nanbeige", "glm5_next",
                 "minimax_m3", "lfm2", "lfm2_moe", "nemotron_h", "kimi_linear", "gemma3",
                 "muse_glimmer",
                 # BeamModel's two loops (fused; plain, under CPU offload).
                 "beam", "beam_unfused")
    # Collected on every base; the files new in 0.5.23 have no spec on the pin.
    if name in specs()
]


def _same(got, want, allocs):
    """Exact on CPU; the CUDA caching allocator rounds each block up to 512 B."""
    from harness.standins.kernels import device

    if device() == "cpu":
        return got == want
    return want <= got <= want + 512 * allocs


@pytest.mark.parametrize("tokens", [1, 96])
@pytest.mark.parametrize("name", FORWARDS)
def test_goes_from_twice_to_once_the_captures(sglang_tp1, name, tokens):
    from harness.memory.models import model_capture_peaks
    from harness.standins.kernels import device

    # The 0.5.23 stand-ins are built at the spec's own width. Layers below the last:
    # pristine 0.5.23 never captures the last layer.
    hidden = specs()[name].tiny.hidden_size
    res = model_capture_peaks(name, tokens, hidden, [2, 4, 5], "float32", device())
    s = res["capture_bytes"]
    assert _same(res["pin"]["capture_path_peak_bytes"], 2 * s, 6), res
    assert _same(res["patched"]["capture_path_peak_bytes"], s, 1), res
