"""The engine benchmark's pure logic (``harness.e2e.bench``, ``make bench ARGS=--engine``),
without an Engine: what it counts as a row, how it compares the variants' features, the
order of its rounds, its medians and ratios, and its check of which SGLang ran."""

from __future__ import annotations

import hashlib

import pytest
import torch

from harness import HarnessError
from harness.e2e import bench, features
from harness.e2e.driver import hidden_summary_of


def test_hidden_summary_counts_prefill_and_decode_rows_and_digests_their_float32_bytes():
    prefill = [[0.5, 1.0, -2.0, 3.0], [0.1, 0.2, 0.3, 0.4]]
    hidden = [prefill, [1.5, 2.5, 3.5, 4.5], [7.0, 8.0, 9.0, 10.0]]  # one prefill, two decode steps
    got = hidden_summary_of(hidden)
    want = hashlib.sha256(features.rows_of(hidden).numpy().astype("<f4").tobytes()).hexdigest()
    assert got == {"hidden_rows": 4, "hidden_width": 4, "hidden_sha256": want}
    moved = [prefill, [1.5, 2.5, 3.5, 4.5], [7.0, 8.0, 9.0, 10.5]]
    assert hidden_summary_of(moved)["hidden_sha256"] != want
    assert hidden_summary_of(None)["hidden_rows"] == 0


def test_rows_are_every_prompt_token_and_every_generated_token_but_the_last():
    assert bench.expected_rows(prompt_len=96, new_tokens=16, prompts=8) == 8 * 111


def test_layer_ids_leave_out_the_last_layer_pristine_cannot_capture():
    assert bench.layer_ids(8) == (1, 4, 6)
    assert all(j + 1 < 8 for j in bench.layer_ids(8))  # layers_to_capture = id + 1 < L
    with pytest.raises(ValueError):
        bench.layer_ids(3)


def test_rounds_rotate_so_each_variant_takes_each_place():
    orders = [bench.rotation(r) for r in range(3)]
    assert orders[0] == list(bench.VARIANTS)
    for place in range(3):
        assert sorted(o[place] for o in orders) == sorted(bench.VARIANTS)


def test_summary_takes_medians_and_ratios_of_rows_per_second():
    secs = {"pristine": [2.0, 9.0, 2.2], "series": [2.1, 1.9, 2.0], "no-capture": [1.0, 1.1, 0.9]}
    samples = [{"variant": v, "seconds": s} for v, ss in secs.items() for s in ss]
    out = bench.summarize(samples, rows=1000, width=768)
    assert out["variants"]["pristine"]["median_s"] == 2.2  # the outlier 9.0 does not count
    assert out["variants"]["series"]["rows_per_s"] == pytest.approx(500.0)
    assert out["variants"]["series"]["feature_mib_per_s"] == pytest.approx(500 * 768 * 4 / 2**20)
    assert out["ratios"] == pytest.approx({"series/pristine": 2.2 / 2.0, "pristine/no-capture": 1.0 / 2.2,
                                           "series/no-capture": 1.0 / 2.0})
    assert "paired_ratios" in out and out["paired_ratios"] == {}  # no rounds given


def test_paired_ratios_are_medians_of_per_round_ratios():
    # Round 1 is slow for everyone (load): the paired ratio is unmoved by it.
    secs = {0: {"pristine": 2.0, "series": 1.0, "no-capture": 1.0},
            1: {"pristine": 8.0, "series": 4.0, "no-capture": 4.0},
            2: {"pristine": 2.2, "series": 1.1, "no-capture": 1.0}}
    samples = [{"variant": v, "round": r, "seconds": t} for r, vs in secs.items() for v, t in vs.items()]
    out = bench.summarize(samples, rows=100, width=8)
    assert out["paired_ratios"]["series/pristine"] == pytest.approx(2.0)
    assert out["paired_ratios"]["pristine/no-capture"] == pytest.approx(0.5)
    assert out["paired_ratios"]["series/no-capture"] == pytest.approx(1.0)


def test_provenance_must_be_the_tree_each_variant_names(tmp_path):
    pristine = tmp_path / "pristine" / "python"
    inside = {"aux_hidden_states": str(pristine / "sglang/srt/layers/aux_hidden_states.py"),
              "llama_collector": "list"}
    wheel = {"aux_hidden_states": "/site-packages/sglang/srt/layers/aux_hidden_states.py",
             "llama_collector": "packer"}
    assert "pristine export" in bench.check_provenance("pristine", [inside], pristine)
    assert "patched wheel" in bench.check_provenance("series", [wheel], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("pristine", [wheel], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("series", [dict(wheel, llama_collector="list")], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("no-capture", [], pristine)
