"""Multi-rank runner: warm pools of spawned rank processes, and SGLang's distributed
state inside them (:mod:`harness.ranks.sglang`).

``get_pool(world_size, backend, init_fn)`` hands out a cached, warm
:class:`~harness.ranks.pool.RankPool`; ``pool.run(fn, ...)`` calls ``fn(rank,
world_size, ...)`` on every rank and returns the per-rank results, or raises one
:class:`~harness.ranks.failures.RankError` naming every failed rank.
"""

from harness.ranks.child import resolve_callable
from harness.ranks.failures import PoolBrokenError, RankError
from harness.ranks.pool import RankPool, close_all_pools, get_pool
from harness.ranks.rendezvous import init_torch_distributed

__all__ = [
    "RankError",
    "PoolBrokenError",
    "RankPool",
    "get_pool",
    "close_all_pools",
    "init_torch_distributed",
    "resolve_callable",
]
