"""SGLang's own GroupCoordinators over the runner + shim (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os

import pytest
import rank_tasks

# Written against the pin's internals (LayerCommunicator, server-args globals).
pytestmark = pytest.mark.bases("0.5.13.post1")


TP_SIZES = [2] + ([4] if os.environ.get("HARNESS_RUNNER_FULL") else [])


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.world_size(tp)) for tp in TP_SIZES])
def test_sglang_all_reduce_and_gather_exact(rank_pool, tp):
    pool = rank_pool(tp)
    results = pool.run(rank_tasks.sglang_collectives)
    assert len(results) == tp
    for rank, res in enumerate(results):
        assert res["tp_sum_exact"] and res["attn_sum_exact"] and res["attn_gather_exact"], (rank, res)
        assert (res["tp_size"], res["tp_rank"], res["attn_tp_size"]) == (tp, rank, tp)
        assert not res["ca"]
        if pool.backend == "gloo":
            assert res["device"] == "cpu" and not res["pynccl"]
    assert all(r["sum"] == results[0]["sum"] for r in results)
    # the pool is warm: a second case reuses it
    pids = pool.pids
    assert rank_pool(tp) is pool
    assert pool.run(rank_tasks.sglang_collectives)[0]["tp_sum_exact"] and pool.pids == pids


def test_sglang_tp1_in_process_idempotent(sglang_tp1):
    # In this worker, as the TP = 1 suites use it (the sglang_tp1 fixture made the
    # first call); a second call returns the same state.
    res = rank_tasks.sglang_in_process_tp1(0, 1)
    assert res["same_cfg"] and res["server_args_tp"] == 1
    assert res["tp_sum_exact"] and res["attn_sum_exact"] and res["attn_gather_exact"]
    assert (res["tp_size"], res["attn_tp_size"]) == (1, 1)
