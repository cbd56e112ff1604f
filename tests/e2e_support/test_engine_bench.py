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
    # The raw form (return_raw_hidden_states): one tensor, the same summary.
    assert hidden_summary_of(features.rows_of(hidden)) == got


def test_rows_are_every_prompt_token_and_every_generated_token_but_the_last():
    assert bench.expected_rows(prompt_len=96, new_tokens=16, prompts=8) == 8 * 111


def test_layer_ids_leave_out_the_last_layer_pristine_cannot_capture():
    assert bench.layer_ids(8) == (1, 4, 6)
    assert bench.layer_ids(6, 4) == (1, 2, 3, 4)
    for layers, k in ((8, 3), (6, 3), (6, 4)):
        ids = bench.layer_ids(layers, k)
        assert len(set(ids)) == k and all(j + 1 < layers for j in ids)  # layers_to_capture = id + 1 < L
    with pytest.raises(ValueError):
        bench.layer_ids(4)


def test_widths_are_k_times_h():
    for width in (768, 4096, 12288):
        k, h = bench.shape(width)
        assert k * h == width and k <= 4
    with pytest.raises(ValueError):
        bench.shape(1000)


def test_rounds_rotate_so_each_variant_takes_each_place():
    n = len(bench.VARIANTS)
    orders = [bench.rotation(r) for r in range(n)]
    assert orders[0] == list(bench.VARIANTS)
    for place in range(n):
        assert sorted(o[place] for o in orders) == sorted(bench.VARIANTS)


def test_the_flag_diagnostic_runs_up_to_its_width_and_the_rest_rotate_without_it():
    assert bench.variants_at(bench.FLAG_MAX_WIDTH) == bench.VARIANTS
    wide = bench.variants_at(bench.FLAG_MAX_WIDTH + 1)
    assert "series-flag" not in wide and set(bench.RATIOED[:3]) < set(wide) and "plain" in wide
    orders = [bench.rotation(r, wide) for r in range(len(wide))]
    for place in range(len(wide)):
        assert sorted(o[place] for o in orders) == sorted(wide)


def test_ratio_to_plain_is_per_round_then_median_min_max():
    # Round 2 is slow for everyone (load): the per-round ratio is unmoved by it.
    secs = {1: {"pristine-lists": 2.0, "series-lists": 1.25, "series-arrays": 1.0, "plain": 1.0},
            2: {"pristine-lists": 8.0, "series-lists": 5.0, "series-arrays": 4.0, "plain": 4.0},
            3: {"pristine-lists": 2.5, "series-lists": 1.0, "series-arrays": 1.1, "plain": 1.0}}
    samples = [{"variant": v, "round": r, "seconds": t} for r, vs in secs.items() for v, t in vs.items()]
    out = bench.ratios_to_plain(samples)
    assert set(out) == set(bench.CAPTURING)
    assert out["pristine-lists"]["median"] == pytest.approx(0.5)
    assert out["pristine-lists"]["min"] == pytest.approx(0.4) and out["pristine-lists"]["max"] == pytest.approx(0.5)
    assert out["series-arrays"]["median"] == pytest.approx(1.0)
    assert out["series-arrays"]["min"] == pytest.approx(1 / 1.1)
    assert out["series-lists"]["n"] == 3


def test_projection_is_the_share_of_a_tokens_time_at_the_widest_width():
    rp = [{"width": w, "batch": b, "variant": v, "rows_per_s": rate}
          for w in (768, 12288) for b in (1, 64)
          for v, rate in (("pristine-lists", 1000.0), ("series-lists", 4000.0), ("series-arrays", 40000.0))]
    p = bench.projection(rp, dict(bench.GPU_ASSUMPTIONS, prefill_tokens_per_s=40000.0))
    assert (p["width"], p["batch"], p["row_bytes"]) == (12288, 64, 12288 * 2)
    assert p["variants"]["series-arrays"]["share_of_prefill_token"] == pytest.approx(0.5)
    assert p["variants"]["pristine-lists"]["share_of_prefill_token"] == pytest.approx(40 / 41)
    assert p["floor"]["pcie_rows_per_s"] == pytest.approx(50e9 / (12288 * 2))


def test_provenance_must_be_the_tree_each_variant_names(tmp_path):
    pristine = tmp_path / "pristine" / "python"
    inside = {"aux_hidden_states": str(pristine / "sglang/srt/layers/aux_hidden_states.py"),
              "llama_collector": "list"}
    wheel = {"aux_hidden_states": "/site-packages/sglang/srt/layers/aux_hidden_states.py",
             "llama_collector": "packer"}
    assert "pristine export" in bench.check_provenance("pristine-lists", [inside], pristine)
    assert "patched wheel" in bench.check_provenance("series-arrays", [wheel], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("pristine-lists", [wheel], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("series-lists", [dict(wheel, llama_collector="list")], pristine)
    with pytest.raises(HarnessError):
        bench.check_provenance("plain", [], pristine)
