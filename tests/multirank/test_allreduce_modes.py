"""The CPU stand-in of CUDA's custom all-reduce (harness.standins.kernels.allreduce_mode),
through SGLang's own ``tensor_model_parallel_all_reduce`` at TP 2 over gloo: "inplace"
(the CPU path: the input holds the sum and is returned, as NCCL's in-place all-reduce)
and "custom" (SGLang's custom all-reduce branch: a fresh output, the input left as it
was, as the CUDA kernel writes its own ``out``). The parity tier's ``custom_ar`` cases
run every model under the latter."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), pytest.mark.multirank,
              pytest.mark.world_size(2)]


def test_custom_all_reduce_is_out_of_place(rank_pool):
    results = [r for rank in rank_pool(2).run("harness.suites.norms:all_reduce_modes")
               for r in rank]
    assert len(results) == 2 * 2 * 2
    for res in results:
        where = f"rank {res['rank']} {res['group']} {res['mode']}"
        assert res["complete_sum"], f"{where}: not the complete sum"
        if res["mode"] == "custom":
            assert not res["same_tensor"] and res["input_untouched"], (
                f"{where}: the custom all-reduce wrote its input or returned it")
            assert res["custom"] == 1, f"{where}: {res['custom']} custom all-reduces ran"
        else:
            assert res["same_tensor"] and not res["input_untouched"], (
                f"{where}: the CPU all-reduce is in place")
            assert res["custom"] == 0, f"{where}: a custom all-reduce ran"
