"""SGLang's fused all-reduce + residual + RMSNorm when the FlashInfer kernel declines.

The previous layer deferred its all-reduce, so ``x`` is each rank's partial sum. When
FlashInfer declines (no workspace, a non-contiguous input), the norm must still
all-reduce ``x``, over the group the kernel would have reduced over (for the MoE group:
expert parallel when EP > 1, else MoE tensor parallel), add ``post_residual_addition``
(Qwen3-VL's deepstack) once, and, like the kernel, leave its input residual untouched
(the communicator's capture logic relies on it). At the pin, the communicator's unfused
branch for a deferred sum must reduce over the same group. TP = 2 over gloo, EP 1 and 2,
every rank against the norm of the complete sum.
"""

from __future__ import annotations

import pytest
import torch

from harness.patchset.layout import layout

# 0.5.23's fallback already all-reduces over its workspace's group; on the pin this is
# the series' patch.
_ON_PIN = layout().base is None
pytestmark = [pytest.mark.bases("0.5.13.post1", "0.5.23"), pytest.mark.multirank,
              pytest.mark.world_size(2)] + ([pytest.mark.guards("fused-norm-fallback")] if _ON_PIN else [])

EP_INIT = "harness.suites.norms:init_ep"


def _check(results, with_addition: bool) -> None:
    for res in results:
        r = res["rank"]
        assert torch.equal(res["residual_out"], res["want_residual"]), (
            f"rank {r} (groups {res['groups']}): residual out is not all_reduce(x) + residual"
            f"{' + post_residual_addition' if with_addition else ''} (max abs diff "
            f"{(res['residual_out'] - res['want_residual']).abs().max().item()})"
        )
        assert torch.allclose(res["out"], res["want_out"], rtol=0, atol=1e-12), (
            f"rank {r}: norm output differs from the norm of the complete sum"
        )
        assert res["residual_untouched"], f"rank {r}: the input residual was written in place"


@pytest.mark.parametrize("use_attn_tp_group", [True, False], ids=["attn-tp", "moe-group"])
@pytest.mark.parametrize("with_addition", [False, True], ids=["plain", "deepstack"])
def test_declined_fused_norm_reduces_and_adds_once(rank_pool, with_addition, use_attn_tp_group):
    results = rank_pool(2).run("harness.suites.norms:fused_norm_declined",
                               with_addition=with_addition, use_attn_tp_group=use_attn_tp_group)
    _check(results, with_addition)


@pytest.mark.parametrize("with_addition", [False, True], ids=["plain", "deepstack"])
def test_declined_fused_norm_reduces_over_the_expert_parallel_group(rank_pool, with_addition):
    """EP = TP = 2: the MoE tensor parallel group has size 1, and FlashInfer reduces a
    deferred MoE output over the EP group; so must its fallback."""
    results = rank_pool(2, init_fn=EP_INIT).run("harness.suites.norms:fused_norm_declined",
                                                with_addition=with_addition,
                                                use_attn_tp_group=False)
    assert results[0]["groups"] == {"moe_ep": 2, "moe_tp": 1}, results[0]["groups"]
    _check(results, with_addition)


@pytest.mark.bases("0.5.13.post1")
def test_communicator_unfused_branch_reduces_over_the_expert_parallel_group(rank_pool):
    """The pin's LayerCommunicator.prepare_attn, where a deferred sum's fusion does not
    apply, at EP = TP = 2."""
    results = rank_pool(2, init_fn=EP_INIT).run("harness.suites.norms:unfused_deferred_prepare_attn")
    assert results[0]["groups"] == {"moe_ep": 2, "moe_tp": 1}, results[0]["groups"]
    _check(results, with_addition=False)
