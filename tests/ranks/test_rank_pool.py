"""The multi-rank runner itself: results, reuse, and failure semantics (no SGLang: fast)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import rank_tasks

from harness.ranks import (
    PoolBrokenError,
    RankError,
    RankPool,
    get_pool,
    init_torch_distributed,
)


def _gone(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids, seconds=5.0) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


@pytest.fixture
def pool2():
    pool = RankPool(2, init_fn=None, timeout=30)
    yield pool
    pool.close()


def test_results_from_all_ranks(pool2):
    out = pool2.run(rank_tasks.echo, 5, key="v")
    assert [o[:4] for o in out] == [(0, 2, (5,), {"key": "v"}), (1, 2, (5,), {"key": "v"})]
    assert [o[4] for o in out] == pool2.pids
    # "module:qualname" spec works too
    assert [o[0] for o in pool2.run("rank_tasks:echo")] == [0, 1]


def test_many_cases_through_one_pool():
    pool = get_pool(2)
    pids = list(pool.pids)
    t0 = time.monotonic()
    for i in range(50):
        out = pool.run(rank_tasks.echo, i)
        assert [o[2] for o in out] == [(i,), (i,)]
    per_call = (time.monotonic() - t0) / 50
    assert get_pool(2) is pool and pool.pids == pids
    assert [o[4] for o in pool.run(rank_tasks.echo)] == pids
    assert per_call < 0.5, per_call


def test_unpicklable_task_is_a_type_error_and_pool_survives(pool2):
    with pytest.raises(TypeError, match="not picklable"):
        pool2.run(lambda r, w: r)
    assert pool2.run(rank_tasks.echo)[1][0] == 1


def test_rank_raises_one_error_with_rank_and_traceback(pool2):
    pids = pool2.pids
    with pytest.raises(RankError) as ei:
        pool2.run(rank_tasks.raise_on, 1, "boom-7f3a")
    err = ei.value
    msg = str(err)
    assert err.kind == "raised" and err.rank == 1
    assert "rank 1" in msg and "raised" in msg
    assert "Traceback (most recent call last)" in msg and "ValueError: boom-7f3a" in msg
    assert "in raise_on" in msg  # the rank's own frame
    assert err.states[0] == "finished" and err.states[1] == "raised"
    assert "rank 0: finished" in msg
    assert str(pickle.loads(pickle.dumps(err))) == msg  # crosses xdist/process boundaries
    assert pool2.broken
    assert _wait_gone(pids) == []
    with pytest.raises(PoolBrokenError):
        pool2.run(rank_tasks.echo)


@pytest.mark.parametrize(
    "how, expect",
    [("SIGKILL", "killed by SIGKILL"), ("SIGSEGV", "killed by SIGSEGV"), ("exit", "exited with code 7")],
)
def test_rank_dies(pool2, how, expect):
    pids = pool2.pids
    with pytest.raises(RankError) as ei:
        pool2.run(rank_tasks.die_on, 1, how)
    msg = str(ei.value)
    assert ei.value.kind == "died" and ei.value.rank == 1
    assert f"rank 1 (pid {pids[1]}) died: {expect}" in msg
    assert "rank 0: finished" in msg
    if how == "SIGSEGV":  # faulthandler's fatal-signal dump names the frame
        assert "Fatal Python error: Segmentation fault" in msg and "die_on" in msg
    assert _wait_gone(pids) == []


def test_rank_hang_dumps_stacks_and_kills_everything(tmp_path, monkeypatch):
    marker = tmp_path / "grandchild"
    pool = RankPool(2, init_fn=None, timeout=30, env={"RANKTEST_GRANDCHILD_FILE": str(marker)})
    pids = pool.pids
    t0 = time.monotonic()
    with pytest.raises(RankError) as ei:
        pool.run(rank_tasks.hang_on, 1, True, timeout=3)
    elapsed = time.monotonic() - t0
    msg = str(ei.value)
    assert ei.value.kind == "timeout" and ei.value.rank == 1
    assert "deadline passed" in msg and "rank(s) 1 still running" in msg
    assert "rank 0: finished" in msg and "rank 1: running" in msg
    # faulthandler dump of rank 1's Python stack, down to the hanging frame
    assert "rank 1 Python stacks at the deadline" in msg
    assert "hang_here_marker" in msg and "hang_on" in msg
    assert elapsed < 3 + 10, elapsed
    grandchild = int((tmp_path / "grandchild.1").read_text())
    assert _wait_gone(pids + [grandchild]) == []
    assert pool.broken


def test_broken_pool_is_replaced_by_get_pool():
    pool = get_pool(2, timeout=30)
    old = list(pool.pids)
    with pytest.raises(RankError):
        pool.run(rank_tasks.raise_on, 0, "first")
    fresh = get_pool(2)
    assert fresh is not pool and fresh.healthy
    assert set(fresh.pids).isdisjoint(old)
    assert [o[0] for o in fresh.run(rank_tasks.echo)] == [0, 1]


def test_init_failure_names_rank():
    with pytest.raises(RankError) as ei:
        RankPool(2, init_fn="rank_tasks:raise_on", init_kwargs={}, timeout=10)
    # raise_on(rank, world_size, init_method=..., backend=...) -> TypeError in every rank
    assert ei.value.kind == "init"
    assert "during init" in str(ei.value) and "TypeError" in str(ei.value)


def test_get_pool_does_not_respawn_a_pool_whose_init_raised():
    """A raising init hook is deterministic: the next request raises the first error
    again at once, naming the rank, instead of spawning (and importing) it again."""
    with pytest.raises(RankError) as first:
        get_pool(2, init_fn="rank_tasks:raise_on", timeout=10)
    with pytest.raises(RankError) as again:
        get_pool(2, init_fn="rank_tasks:raise_on", timeout=10)
    assert again.value.kind == "init" and again.value.rank == first.value.rank
    assert "not respawned" in str(again.value) and "TypeError" in str(again.value)


def test_two_pools_rendezvous_without_collision():
    """Two torch.distributed pools at once in one process (as under pytest -n)."""
    a = RankPool(2, init_fn=init_torch_distributed, timeout=60)
    b = RankPool(2, init_fn="harness.ranks:init_torch_distributed", timeout=60)
    try:
        assert a.run(rank_tasks.torch_all_reduce) == [[3.0] * 4] * 2
        assert b.run(rank_tasks.torch_all_reduce) == [[3.0] * 4] * 2
        # one rank raises while its peer waits in a collective: the error carries the
        # raiser's traceback and the blocked peer's stack
        with pytest.raises(RankError) as ei:
            a.run(rank_tasks.raise_or_collective, 1, timeout=30)
        msg = str(ei.value)
        assert ei.value.rank == 1 and "RuntimeError: left the collective" in msg
        assert "rank 0: running" in msg and "rank 0 Python stacks" in msg and "torch_all_reduce" in msg
    finally:
        a.close()
        b.close()
    assert _wait_gone(a.pids + b.pids) == []


def test_close_and_atexit_leave_no_process(tmp_path):
    pool = RankPool(1, init_fn=None)
    pids = pool.pids
    pool.close()
    assert _wait_gone(pids) == []
    # interpreter exit without close(): atexit tears the pool down
    script = tmp_path / "leaky.py"
    script.write_text(textwrap.dedent("""
        import sys
        from harness.ranks import get_pool
        if __name__ == "__main__":
            pool = get_pool(2)
            print(" ".join(map(str, pool.pids)), flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    child_pids = [int(p) for p in out.stdout.split()]
    assert len(child_pids) == 2
    assert _wait_gone(child_pids) == []


def test_fixture_skips_nccl_without_enough_gpus(rank_pool):
    with pytest.raises(pytest.skip.Exception, match="backend nccl needs 64 GPUs"):
        rank_pool(64, backend="nccl")
