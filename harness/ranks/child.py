"""The rank side of a pool: run the init hook once, then serve tasks until closed.

A rank leads its own process group (the parent kills it and its descendants with
``killpg``), exits when its parent dies, and registers faulthandler for fatal signals
and for the parent's SIGUSR1 stack request. Stdlib only at import time.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

from harness.ranks.failures import STACK_SIGNAL
from harness.ranks.rendezvous import init_method

FnSpec = Callable[..., Any] | str


def resolve_callable(spec: FnSpec) -> Callable[..., Any]:
    """``"pkg.module:qual.name"`` (or ``"pkg.module.func"``) -> the object; callables pass."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"expected a callable or 'module:qualname', got {spec!r}")
    if ":" in spec:
        mod_name, qual = spec.split(":", 1)
    else:
        mod_name, _, qual = spec.rpartition(".")
    obj: Any = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def spec_key(spec: FnSpec | None) -> str | None:
    if spec is None or isinstance(spec, str):
        return spec
    return f"{spec.__module__}:{spec.__qualname__}"


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent_watchdog(owner_pid: int) -> None:
    # A rank must never outlive the pool's owner (e.g. a pytest worker SIGKILLed). Its
    # parent is the owner under spawn and the forkserver under forkserver, so the check
    # is on the owner's pid, not on getppid().
    while True:
        time.sleep(1.0)
        if not _owner_alive(owner_pid):
            os._exit(70)


def _child_send(conn: Connection, msg: tuple) -> None:
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # result not picklable: report that instead
        tag, call_id = msg[0], msg[1]
        data = pickle.dumps(
            ("err", call_id, f"rank result of {tag!r} is not picklable:\n{traceback.format_exc()}"),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
    conn.send_bytes(data)


def rank_main(
    rank: int,
    world_size: int,
    conn: Connection,
    ppid: int,
    workdir: str,
    init_fn: FnSpec | None,
    init_kwargs: dict[str, Any],
    backend: str,
    env: dict[str, str],
) -> None:
    try:
        os.setpgid(0, 0)  # own process group: the parent kills it (and descendants) with killpg
    except OSError:
        pass
    os.environ.update(env)
    threading.Thread(target=_parent_watchdog, args=(ppid,), daemon=True).start()
    stack_file = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    fatal_file = open(os.path.join(workdir, f"rank{rank}.fatal"), "w")
    faulthandler.enable(file=fatal_file, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)

    try:
        if init_fn is not None:
            resolve_callable(init_fn)(
                rank,
                world_size,
                init_method=init_method(workdir),
                backend=backend,
                **init_kwargs,
            )
    except BaseException:
        _child_send(conn, ("init_err", -1, traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _child_send(conn, ("ready", -1, os.getpid()))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            msg = pickle.loads(data)
        except BaseException:
            _child_send(conn, ("err", -1, "could not unpickle the task:\n" + traceback.format_exc()))
            continue
        if msg[0] == "close":
            break
        _, call_id, fn, args, kwargs = msg
        try:
            result = resolve_callable(fn)(rank, world_size, *args, **kwargs)
        except BaseException:
            _child_send(conn, ("err", call_id, traceback.format_exc()))
        else:
            _child_send(conn, ("ok", call_id, result))
    # Clean close: run the atexit hooks (e.g. the SGLang shim frees its shared-memory
    # ring buffers), then skip interpreter teardown: process-group destructors
    # (gloo/nccl) can block. The parent kills the rank if this takes too long.
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
