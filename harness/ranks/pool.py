"""Multi-rank runner: a pool of spawned rank processes that serves many test cases.

Modelled on PyTorch's ``MultiProcContinuousTest``: ``world_size`` ranks are started
once (multiprocessing *spawn*), each runs an init hook once (e.g.
``harness.ranks.sglang:init_sglang_distributed``) and then serves tasks::

    pool = get_pool(2, init_fn="harness.ranks.sglang:init_sglang_distributed")
    results = pool.run(my_module_level_fn, 3, scale=2.0)   # fn(rank, world_size, 3, scale=2.0)

Failure semantics (one :class:`RankError` per failed ``run``):

* a rank raises -> the error names the rank and carries its formatted traceback and
  every other rank's state (finished / raised / running / dead);
* a rank dies (signal, ``os._exit``) -> the error names the rank and the signal / exit
  code (plus faulthandler's fatal-signal dump when there is one);
* the call passes its deadline -> every live rank's Python stacks are dumped
  (faulthandler on SIGUSR1 into a per-rank file) and put into the error.

After any failure the pool is killed (each rank leads its own process group, so
``killpg`` takes its descendants too) and marked broken; :func:`get_pool` hands out a
fresh one next time. Pools close on :meth:`RankPool.close` and at interpreter exit.

Rendezvous never collides under pytest-xdist: each pool gets a private temp dir and
hands ``file://<dir>/rendezvous`` to the init hook.

The pool is split along its seams: this module holds the process lifecycle (spawn,
call, kill, close, the per-process cache); :mod:`harness.ranks.child` the rank side;
:mod:`harness.ranks.rendezvous` the private work dir and init method;
:mod:`harness.ranks.failures` the error that names every failed rank.

Stdlib only at import time; torch is imported lazily (only the init hooks need it).
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from harness.ranks.child import FnSpec, rank_main, spec_key
from harness.ranks.failures import (
    PoolBrokenError,
    RankError,
    collect_stacks,
    describe_exit,
    fatal_dumps,
    format_failure,
    state_lines,
)
from harness.ranks.rendezvous import new_workdir

__all__ = ["RankPool", "get_pool", "close_all_pools"]


@dataclass
class _Rank:
    rank: int
    proc: Any  # multiprocessing.Process
    conn: Connection
    pid: int = 0
    state: str = "starting"  # starting|idle|running|finished|raised|dead|killed
    result: Any = None
    tb: str = ""
    exit_desc: str = ""
    extra: dict = field(default_factory=dict)


_LIVE_POOLS: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


class RankPool:
    """``world_size`` spawned ranks that each run ``init_fn`` once, then serve ``run`` calls.

    ``init_fn(rank, world_size, *, init_method, backend, **init_kwargs)``: a callable or
    ``"module:qualname"``; ``None`` for no init (no torch.distributed at all).
    ``timeout``: default per-call deadline in seconds; ``start_timeout``: spawn + init.
    ``wait``: False returns as soon as the ranks are spawned; they import and run
    ``init_fn`` in the background and the first call waits for them (so a test session
    can start a pool early and do other work meanwhile). Init failures surface there.
    ``preload``: modules to import once in a forkserver that CPU (gloo) ranks fork from,
    instead of every rank importing them after a spawn (SGLang costs ~17 s of CPU per
    import on these machines). Without it, or on a machine with NVIDIA devices (CUDA
    must not be touched before a fork), ranks are spawned.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        init_fn: FnSpec | None = None,
        *,
        init_kwargs: dict[str, Any] | None = None,
        timeout: float = 300.0,
        start_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        stack_grace: float = 2.0,
        wait: bool = True,
        preload: tuple[str, ...] = (),
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        import multiprocessing as mp

        self.world_size = world_size
        self.backend = backend
        self.init_fn = init_fn
        self.init_kwargs = dict(init_kwargs or {})
        self.timeout = timeout
        self.stack_grace = stack_grace
        self.broken: str | None = None
        # The error of an init hook that raised (deterministic: get_pool raises it again
        # instead of spawning the same failing pool for every test that asks).
        self.init_failure: RankError | None = None
        self.closed = False
        self.calls = 0
        self._current_call = -1
        self._killed = False
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._ready = False
        self._start_deadline = 0.0
        self.spawn_seconds: float | None = None
        self.workdir = new_workdir(world_size)
        child_env = dict(env or {})
        if backend == "gloo":
            # gloo means CPU ranks: hide any GPU the host has (SGLang picks cuda:<rank> as
            # its device whenever CUDA is visible). Pass env={"CUDA_VISIBLE_DEVICES": ...}
            # to override.
            child_env.setdefault("CUDA_VISIBLE_DEVICES", "")
        self.start_method = start_method(backend, preload)
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Takes effect when this process starts its forkserver (its first such pool).
            global _FORKSERVER_PRELOAD
            _FORKSERVER_PRELOAD = tuple(preload)
            ctx.set_forkserver_preload(list(preload))
        self._ranks: list[_Rank] = []
        self._t0 = t0 = time.monotonic()
        self._start_deadline = t0 + start_timeout
        try:
            _spawn(ctx, self._ranks, world_size, self.workdir, init_fn, self.init_kwargs, backend, child_env)
            _LIVE_POOLS.add(self)
            if wait:
                self._wait_ready()
        except BaseException:
            self._kill_all()
            raise

    # ----------------------------------------------------------------- info
    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._ranks]

    @property
    def healthy(self) -> bool:
        return not self.broken and not self.closed and all(r.proc.is_alive() for r in self._ranks)

    def _desc(self) -> str:
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, init_fn={spec_key(self.init_fn)!r})"

    def __repr__(self) -> str:
        status = "broken" if self.broken else "closed" if self.closed else "ok"
        return f"{self._desc()[:-1]}, {status})"

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- start-up
    def _wait_ready(self) -> None:
        """Until every rank has run its init hook (once; a failure breaks the pool)."""
        if self._ready:
            return
        pending = {r.rank for r in self._ranks if r.state == "starting"}
        while pending:
            failure = self._pump(pending, self._start_deadline, phase="init")
            if failure is not None:
                if failure.tracebacks:  # an init hook raised, not a death or a deadline
                    self.init_failure = failure
                raise failure
            pending = {r.rank for r in self._ranks if r.state == "starting"}
        for r in self._ranks:
            r.state = "idle"
        self._ready = True
        self.spawn_seconds = time.monotonic() - self._t0

    # ----------------------------------------------------------------- running
    def run(self, fn: FnSpec, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; per-rank results.

        ``timeout`` (keyword-only, not forwarded) overrides the pool's per-call deadline;
        use :meth:`call` to pass a ``timeout`` kwarg through to ``fn``.
        """
        return self.call(fn, args, kwargs, timeout=timeout)

    def call(
        self,
        fn: FnSpec,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        with self._lock:
            if os.getpid() != self._owner_pid:
                raise PoolBrokenError("RankPool used from a forked child of its owner")
            if self.broken:
                raise PoolBrokenError(f"rank pool is broken (earlier failure: {self.broken}); use get_pool() for a new one")
            if self.closed:
                raise PoolBrokenError("rank pool is closed")
            self._wait_ready()
            self.calls += 1
            call_id = self._current_call = self.calls
            try:
                payload = pickle.dumps(("run", call_id, fn, tuple(args), dict(kwargs or {})),
                                       protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                raise TypeError(f"task for the rank pool is not picklable (use a module-level function): {e}") from e
            for r in self._ranks:
                r.state, r.result, r.tb = "running", None, ""
            for r in self._ranks:
                try:
                    r.conn.send_bytes(payload)
                except OSError:
                    r.state = "dead"
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            pending = {r.rank for r in self._ranks if r.state == "running"}
            failure: RankError | None = None
            if len(pending) != self.world_size:
                failure = self._fail_dead(phase=f"call {call_id}")
            try:
                while pending and failure is None:
                    failure = self._pump(pending, deadline, phase=f"call {call_id}", call_id=call_id)
                    pending = {r.rank for r in self._ranks if r.state == "running"}
            except BaseException as e:  # KeyboardInterrupt, ...: ranks are mid-task; kill them
                self._break(f"interrupted in call {call_id}: {type(e).__name__}")
                raise
            if failure is not None:
                raise failure
            out = [r.result for r in self._ranks]
            for r in self._ranks:
                r.state, r.result = "idle", None
            return out

    def _pump(self, pending: set[int], deadline: float, *, phase: str, call_id: int = -1) -> RankError | None:
        """Wait for one batch of events; update rank states; return a failure or None."""
        by_conn = {self._ranks[i].conn: self._ranks[i] for i in pending}
        by_sentinel = {self._ranks[i].proc.sentinel: self._ranks[i] for i in pending}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return self._fail_timeout(phase)
        ready = wait(list(by_conn) + list(by_sentinel), timeout=remaining)
        if not ready:
            return self._fail_timeout(phase)
        first_bad: _Rank | None = None
        for obj in ready:
            r = by_conn.get(obj)  # type: ignore[call-overload]
            if r is not None:
                if self._drain(r, call_id) and first_bad is None:
                    first_bad = r
        for obj in ready:
            r = by_sentinel.get(obj)  # type: ignore[call-overload]
            if r is not None and r.state in ("starting", "running"):
                # drain a reply that raced with the exit, then call it dead
                if not self._drain(r, call_id) and r.state in ("starting", "running"):
                    r.proc.join(0.5)
                    r.state, r.exit_desc = "dead", describe_exit(r.proc.exitcode)
                if r.state in ("dead", "raised") and first_bad is None:
                    first_bad = r
        if first_bad is not None:
            return self._fail_rank(first_bad, phase)
        return None

    def _drain(self, r: _Rank, call_id: int | None = None) -> bool:
        """Read all pending messages of a rank; True when it reported a failure."""
        if call_id is None:
            call_id = self._current_call
        bad = False
        try:
            while r.conn.poll():
                tag, cid, payload = pickle.loads(r.conn.recv_bytes())
                if tag == "ready":
                    r.state, r.pid = "ready", payload
                elif tag == "init_err":
                    r.state, r.tb = "raised", payload
                    bad = True
                elif tag == "ok" and cid == call_id:
                    r.state, r.result = "finished", payload
                elif tag == "err" and cid in (call_id, -1):
                    r.state, r.tb = "raised", payload
                    bad = True
        except (EOFError, OSError):
            if r.state in ("starting", "running"):
                r.proc.join(1.0)
                r.state, r.exit_desc = "dead", describe_exit(r.proc.exitcode)
                bad = True
        return bad

    # ----------------------------------------------------------------- failures
    def _settle_others(self, grace: float) -> None:
        """Give the other ranks a short grace to report before their state is recorded."""
        end = time.monotonic() + grace
        while time.monotonic() < end:
            pending = [r for r in self._ranks if r.state in ("starting", "running")]
            if not pending:
                return
            objs = [r.conn for r in pending] + [r.proc.sentinel for r in pending]
            ready = wait(objs, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                return
            for r in pending:
                if r.conn in ready:
                    self._drain(r)
                if r.proc.sentinel in ready and r.state in ("starting", "running"):
                    if not self._drain(r) and r.state in ("starting", "running"):
                        r.proc.join(0.5)
                        r.state, r.exit_desc = "dead", describe_exit(r.proc.exitcode)

    def _fail_rank(self, bad: _Rank, phase: str) -> RankError:
        self._settle_others(grace=min(1.0, self.stack_grace))
        still = [r for r in self._ranks if r.state in ("starting", "running")]
        stacks = collect_stacks(still, self.workdir, self.stack_grace) if still else {}
        state_text, states = state_lines(self._ranks)
        kind = "init" if phase == "init" else ("died" if bad.state == "dead" else "raised")
        tracebacks = {r.rank: r.tb for r in self._ranks if r.state == "raised" and r.tb}
        fatal = fatal_dumps([r for r in self._ranks if r.state == "dead"], self.workdir)
        if bad.state == "dead":
            what = f"rank {bad.rank} (pid {bad.pid}) died: {bad.exit_desc}"
        else:
            what = f"rank {bad.rank} (pid {bad.pid}) raised"
        phase_text = "during init" if phase == "init" else f"in {phase}"
        header = f"{what} {phase_text} of {self._desc()}; ranks: {state_text}"
        msg = format_failure(header, tracebacks, stacks, fatal)
        self._break(f"{what} {phase_text}")
        return RankError(msg, kind=kind, rank=bad.rank, states=states, tracebacks=tracebacks, stacks=stacks)

    def _fail_dead(self, phase: str) -> RankError:
        bad = next(r for r in self._ranks if r.state == "dead")
        bad.proc.join(0.5)
        bad.exit_desc = describe_exit(bad.proc.exitcode)
        return self._fail_rank(bad, phase)

    def _fail_timeout(self, phase: str) -> RankError:
        live = [r for r in self._ranks if r.state in ("starting", "running")]
        stacks = collect_stacks(live, self.workdir, self.stack_grace)
        state_text, states = state_lines(self._ranks)
        names = ", ".join(str(r.rank) for r in live)
        header = (f"deadline passed {'during init' if phase == 'init' else 'in ' + phase} of {self._desc()}: "
                  f"rank(s) {names} still running; ranks: {state_text}")
        tracebacks = {r.rank: r.tb for r in self._ranks if r.state == "raised" and r.tb}
        msg = format_failure(header, tracebacks, stacks, {})
        self._break(f"deadline in {phase}")
        return RankError(msg, kind="timeout", rank=live[0].rank if live else None, states=states,
                         tracebacks=tracebacks, stacks=stacks)

    def _break(self, reason: str) -> None:
        self.broken = reason
        self._kill_all()

    # ----------------------------------------------------------------- teardown
    def _kill_all(self) -> None:
        if self._killed:
            return
        self._killed = True
        for r in self._ranks:
            if r.pid:
                try:
                    os.killpg(r.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                except OSError:
                    pass
            try:
                if r.proc.is_alive():
                    r.proc.kill()
            except Exception:
                pass
        for r in self._ranks:
            try:
                r.proc.join(5.0)
            except Exception:
                pass
            try:
                r.conn.close()
            except Exception:
                pass
        _LIVE_POOLS.discard(self)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def close(self, timeout: float = 5.0) -> None:
        """Ask the ranks to exit; kill whatever is left after ``timeout``. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._owner_pid:
            return
        if not self.broken:
            for r in self._ranks:
                try:
                    r.conn.send_bytes(pickle.dumps(("close",)))
                except Exception:
                    pass
            end = time.monotonic() + timeout
            for r in self._ranks:
                r.proc.join(max(0.0, end - time.monotonic()))
        self._kill_all()  # also reaps process groups (descendants of ranks)


# What this process's forkserver imports (its first forkserver pool's ``preload``).
# multiprocessing keeps one forkserver per process: a pool that wants other modules
# preloaded (another mode of SGLang, e.g. the parity tier's CPU engine) spawns instead.
_FORKSERVER_PRELOAD: tuple[str, ...] | None = None


def _spawn(ctx, ranks: list, world_size: int, workdir: str, init_fn: FnSpec | None,
           init_kwargs: dict[str, Any], backend: str, child_env: dict[str, str]) -> None:
    """Start ``world_size`` rank processes (``rank_main``), appending each to ``ranks`` as
    it starts (so the caller can kill the ones started if a later one fails)."""
    for r in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=rank_main,
            name=f"rank{r}",
            args=(r, world_size, child_conn, os.getpid(), workdir, init_fn, init_kwargs, backend, child_env),
            daemon=False,
        )
        proc.start()
        child_conn.close()
        ranks.append(_Rank(r, proc, parent_conn, pid=proc.pid or 0))


def start_method(backend: str, preload: tuple[str, ...]) -> str:
    """``forkserver`` for CPU ranks with something to preload (the same as this process's
    forkserver, if it has one), else ``spawn``."""
    if preload and backend == "gloo" and not os.path.exists("/dev/nvidiactl"):
        if _FORKSERVER_PRELOAD in (None, tuple(preload)):
            return "forkserver"
    return "spawn"


# --------------------------------------------------------------------------- pool cache

_POOLS: dict[tuple, RankPool] = {}


def get_pool(
    world_size: int,
    backend: str = "gloo",
    init_fn: FnSpec | None = None,
    *,
    init_kwargs: dict[str, Any] | None = None,
    **pool_kwargs: Any,
) -> RankPool:
    """Cached pool per (world_size, backend, init_fn, init_kwargs) in this process.

    A broken or closed pool is thrown away and a fresh one is started.
    """
    key = (os.getpid(), world_size, backend, spec_key(init_fn),
           repr(sorted((init_kwargs or {}).items())))
    pool = _POOLS.get(key)
    if pool is not None and pool.init_failure is not None:
        # Its init hook raised: a new pool would import SGLang again only to raise the same.
        raise RankError(f"not respawned: the init hook already raised for this pool in this "
                        f"process (pid {os.getpid()}); first failure:\n{pool.init_failure}",
                        kind="init", rank=pool.init_failure.rank, states=pool.init_failure.states,
                        tracebacks=pool.init_failure.tracebacks, stacks=pool.init_failure.stacks)
    if pool is not None and not pool.healthy:
        pool.close()
        pool = None
    if pool is None:
        wait = pool_kwargs.pop("wait", True)
        pool = RankPool(world_size, backend, init_fn, init_kwargs=init_kwargs, wait=False, **pool_kwargs)
        _POOLS[key] = pool  # kept before waiting: a raising init hook is remembered
        if wait:
            pool._wait_ready()
    return pool


def close_all_pools() -> None:
    for pool in list(_POOLS.values()) + list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:
            pass
    _POOLS.clear()


atexit.register(close_all_pools)
