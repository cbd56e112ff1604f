"""The Engine driver process: ``python -m harness.e2e.driver --cmd-fd R --resp-fd W``.

It hosts one ``sglang.Engine`` at a time, for the parent (``harness.e2e.engine``),
which sends one JSON command a line on fd R and reads one JSON answer a line on fd W
(stdout and stderr are the log the parent shows on failure):

- ``{"op": "start", "name": ..., "args": {Engine kwargs}, "probe": path | null,
  "setup": ["module:function", ...] | null, "env": {...} | null}`` (``setup``: run in
  every process the Engine starts, before it runs: CPU stand-ins a model family needs;
  ``env``: variables set for this Engine's processes, e.g. SGLang's CPU thread binding)
- ``{"op": "generate", "prompt": str | [str], "sampling": {...}}`` -> ``outputs``; or
  ``"input_ids": [int] | [[int]]`` instead of a prompt, and ``"return_hidden_states":
  true`` to keep each output's ``meta_info["hidden_states"]`` (with ``"hidden_summary":
  true`` only their row count, width and a digest of their float32 bytes: the benchmark's;
  with ``"raw_hidden_states": true`` the Engine is asked for one tensor per request,
  ``return_raw_hidden_states``, handed back as ``hidden_states_raw``: its dtype, shape
  and bytes in base64; ``"image_data": [path | null, ...]``: an image per request)
- ``{"op": "flush"}``: the Engine's ``flush_cache()`` (an empty radix cache, as after start)
- ``{"op": "rss"}`` -> the largest peak RSS (``VmHWM``) among the Engine's processes
- ``{"op": "pause"}`` / ``{"op": "resume"}``: SIGSTOP / SIGCONT the Engine's processes (an
  idle scheduler spins in its event loop; a benchmark stops the Engines waiting their turn)
- ``{"op": "stop"}``: the Engine's own ``shutdown()``; ``{"op": "exit"}``.

The Engine runs here, not in the pytest process: a scheduler that fails sends SIGQUIT
to its parent, whose handler kills its whole process tree (``kill_process_tree``).

**Start method.** SGLang starts its scheduler and detokenizer with ``spawn``: each is a
fresh interpreter that imports SGLang again (about 25 s of CPU each here). With
``HARNESS_E2E_START=forkserver`` (the default) the driver makes them fork from a
multiprocessing forkserver that imported SGLang's scheduler and model modules once per
driver: ``sglang.srt.entrypoints.engine.mp`` is given a forkserver context, and the
Engine's ``set_start_method("spawn", force=True)`` leaves it so. Each child gets the
driver's environment as of ``Process.start()`` (as a spawned child does; a forked one
would otherwise keep the forkserver's). ``shutdown()`` kills the Engine's processes but
spares the forkserver (``kill_process_tree(..., skip_pid=<forkserver>)``), so the next
Engine of the session reuses it. ``HARNESS_E2E_START=spawn`` runs SGLang's own spawn.

Both ways every child is in the CPU engine mode through ``sitecustomize``
(``harness.standins.cpu_engine``), which the parent puts on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import multiprocessing.context
import os
import sys
import time
import traceback
from typing import Any

START_ENV = "HARNESS_E2E_START"
# Imported once by the forkserver: what a scheduler/detokenizer would import after spawn.
PRELOAD = [
    "harness.e2e.preload",
]


def _start_method() -> str:
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise SystemExit(f"{START_ENV} must be forkserver or spawn, got {method!r}")
    return method


SETUP_ENV = "HARNESS_E2E_SETUP"


def run_setup() -> None:
    """Call each ``"module:function"`` of ``HARNESS_E2E_SETUP`` (comma-separated): an
    engine's CPU stand-ins for kernels that have no CPU path (a parity family's
    ``setup``), installed in every process the Engine starts, before it runs."""
    import importlib

    for spec in filter(None, os.environ.get(SETUP_ENV, "").split(",")):
        module, _, function = spec.partition(":")
        getattr(importlib.import_module(module), function)()


class _EnvProcess(multiprocessing.Process):
    """A Process that runs with the environment its parent had at ``start()``, with the
    probe installed when ``HARNESS_E2E_PROBE`` is set there and the setup hooks of
    ``HARNESS_E2E_SETUP`` run."""

    started = 0  # processes started in this driver, all Engines together

    def start(self) -> None:
        self._harness_env = dict(os.environ)
        _EnvProcess.started += 1
        super().start()

    def run(self) -> None:
        import signal

        # The forkserver's SIGQUIT forwarding (harness.e2e.preload) is not the child's.
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        env = getattr(self, "_harness_env", None)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        from harness.e2e import probe

        probe.install_from_env()
        run_setup()
        super().run()


class _ForkserverProcess(_EnvProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        return multiprocessing.context.ForkServerProcess._Popen(process_obj)


class _SpawnProcess(_EnvProcess):
    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj):
        return multiprocessing.context.SpawnProcess._Popen(process_obj)


class _Multiprocessing:
    """``multiprocessing`` as SGLang's engine module sees it: processes of ``method``."""

    def __init__(self, method: str) -> None:
        self.Process = _ForkserverProcess if method == "forkserver" else _SpawnProcess

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        """Kept to the driver's method (the Engine asks for spawn)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


def flat_rows(hidden_states: Any) -> list[list[float]]:
    """``meta_info["hidden_states"]`` as one list of rows: a prefill appends a list of
    rows, a decode step one row."""
    rows: list[list[float]] = []
    for entry in hidden_states or []:
        if entry and isinstance(entry[0], list):
            rows.extend(entry)
        else:
            rows.append(entry)
    return rows


def raw_record(tensor: Any) -> dict[str, Any]:
    """A tensor the Engine returned (``return_raw_hidden_states``), for the JSON answer:
    its type, dtype, shape and bytes (base64). ``raw_tensor`` is the inverse."""
    import base64

    import torch

    if not isinstance(tensor, torch.Tensor):
        return {"type": type(tensor).__name__}
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.numel() else flat
    return {"type": "Tensor", "dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape),
            "data": base64.b64encode(data.numpy().tobytes()).decode()}


def raw_tensor(record: dict[str, Any]) -> Any:
    """The tensor of a ``raw_record`` (a ValueError when the Engine returned no tensor)."""
    import base64

    import torch

    if record.get("type") != "Tensor":
        raise ValueError(f"the Engine returned a {record.get('type')}, not a tensor")
    dtype = getattr(torch, record["dtype"])
    data = bytearray(base64.b64decode(record["data"]))
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(record["shape"])


def hidden_summary_of(hidden_states: Any) -> dict[str, Any]:
    """``meta_info["hidden_states"]`` in brief: rows (a prefill appends a list of rows,
    a decode step one row; or one ``[rows, width]`` tensor, ``return_raw_hidden_states``),
    their width, and the sha256 of the rows as float32 bytes (the same for both forms)."""
    import hashlib
    import struct

    if hasattr(hidden_states, "float") and hasattr(hidden_states, "dim"):  # a tensor
        t = hidden_states.float().contiguous()
        t = t.reshape(1, -1) if t.dim() == 1 else t
        return {"hidden_rows": int(t.shape[0]), "hidden_width": int(t.shape[1]),
                "hidden_sha256": hashlib.sha256(t.numpy().astype("<f4").tobytes()).hexdigest()}
    rows = flat_rows(hidden_states)
    digest = hashlib.sha256()
    for row in rows:
        digest.update(struct.pack(f"<{len(row)}f", *row))
    widths = sorted({len(r) for r in rows})
    return {"hidden_rows": len(rows), "hidden_width": widths[0] if len(widths) == 1 else widths,
            "hidden_sha256": digest.hexdigest()}


def _vm_hwm(pid: int) -> int | None:
    """A process's peak resident set (``VmHWM``), bytes; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


class Driver:
    def __init__(self) -> None:
        self.method = _start_method()
        if self.method == "forkserver":
            multiprocessing.set_forkserver_preload(PRELOAD)
            from multiprocessing import forkserver

            forkserver.ensure_running()  # imports SGLang there while this process does
        import sglang
        import sglang.srt.entrypoints.engine as engine_module

        self.sgl = sglang
        self.engine_module = engine_module
        # The tokenizer manager runs in this process and imports every multimodal
        # processor; Qwen3-VL's (multimodal/processors/qwen_vl.py) imports models/
        # qwen3_5.py, which binds four sgl-kernel CPU ops at import (0.5.23
        # qwen3_5.py:283-298): without their CPU versions the import fails and
        # Qwen3-VL's Engine stops with "No processor registered".
        from harness.standins.cpu_kernels import qwen3_5 as qwen3_5_ops

        qwen3_5_ops.install()
        self.engine = None
        self.name = None
        self.env_keys: list[str] = []
        engine_module.mp = _Multiprocessing(self.method)
        if self.method == "forkserver":
            original = engine_module.kill_process_tree

            @functools.wraps(original)
            def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=None):
                if skip_pid is None:
                    skip_pid = _forkserver_pid()
                return original(parent_pid, include_parent=include_parent, skip_pid=skip_pid,
                                wait_timeout=wait_timeout)

            engine_module.kill_process_tree = kill_process_tree

    def start(self, name: str, args: dict[str, Any], probe: str | None,
              setup: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
        if self.engine is not None:
            self.stop()
        for key in self.env_keys:  # the previous Engine's
            os.environ.pop(key, None)
        self.env_keys = list(env or {})
        os.environ.update(env or {})
        if probe:
            os.environ["HARNESS_E2E_PROBE"] = probe
        else:
            os.environ.pop("HARNESS_E2E_PROBE", None)
        if setup:
            os.environ[SETUP_ENV] = ",".join(setup)
        else:
            os.environ.pop(SETUP_ENV, None)
        t0 = time.monotonic()
        print(f"[harness.e2e.driver] starting engine {name}", file=sys.stderr, flush=True)
        self.engine = self.sgl.Engine(**args)
        self.name = name
        return {"start_s": round(time.monotonic() - t0, 2)}

    def generate(self, prompt: Any, sampling: dict[str, Any], input_ids: Any = None,
                 return_hidden_states: bool = False, hidden_summary: bool = False,
                 raw_hidden_states: bool = False, image_data: Any = None) -> dict[str, Any]:
        """One ``Engine.generate``: text ``prompt`` or token ``input_ids`` (one request
        or a list); with ``return_hidden_states`` each output keeps its
        ``meta_info["hidden_states"]`` (``hidden_summary``: its ``hidden_summary``;
        ``raw_hidden_states``: asked for as one tensor, kept as ``hidden_states_raw``)."""
        if self.engine is None:
            raise RuntimeError("no engine is running")
        t0 = time.monotonic()
        kwargs: dict[str, Any] = {"sampling_params": sampling}
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        else:
            kwargs["prompt"] = prompt
        if return_hidden_states:
            kwargs["return_hidden_states"] = True
        if raw_hidden_states:
            kwargs["return_raw_hidden_states"] = True
        if image_data is not None:
            kwargs["image_data"] = image_data
        out = self.engine.generate(**kwargs)
        elapsed = time.monotonic() - t0
        outs = out if isinstance(out, list) else [out]
        keep = []
        for o in outs:
            info = o.get("meta_info", {})
            meta = {k: v for k, v in info.items()
                    if k.startswith("spec_") or k in ("completion_tokens", "prompt_tokens", "finish_reason",
                                                      "cached_tokens")}
            record = {"output_ids": list(o.get("output_ids") or []), "text": o.get("text"), "meta": meta}
            if return_hidden_states and hidden_summary:
                record.update(hidden_summary_of(info.get("hidden_states")))
                if raw_hidden_states:
                    record["hidden_type"] = type(info.get("hidden_states")).__name__
            elif raw_hidden_states:
                record["hidden_states_raw"] = raw_record(info.get("hidden_states"))
            elif return_hidden_states:
                record["hidden_states"] = info.get("hidden_states")
            keep.append(record)
        return {"outputs": keep, "generate_s": round(elapsed, 4)}

    def flush(self) -> dict[str, Any]:
        if self.engine is None:
            raise RuntimeError("no engine is running")
        ok = self.engine.flush_cache()
        return {"flushed": bool(getattr(ok, "success", ok))}

    def _engine_processes(self) -> list:
        """The processes the Engine runs in: the driver's descendants but its forkserver."""
        import psutil

        skip = _forkserver_pid() if self.method == "forkserver" else None
        return [p for p in psutil.Process().children(recursive=True) if p.pid != skip]

    def signal_engine(self, signum: int) -> dict[str, Any]:
        procs = self._engine_processes()
        for p in procs:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass
        return {"processes": len(procs)}

    def rss(self) -> dict[str, Any]:
        """The largest peak RSS (``VmHWM``, since each started) among the processes the
        Engine runs in (the driver's descendants but its forkserver: the scheduler and
        the detokenizer), and the driver's own."""
        peaks = [_vm_hwm(p.pid) for p in self._engine_processes()]
        return {"engine_peak_rss_bytes": max([p for p in peaks if p] or [0]),
                "driver_peak_rss_bytes": _vm_hwm(os.getpid())}

    def abandon(self) -> None:
        """After a failed command: shut the engine down, and kill whatever a failed start
        left (the forkserver excepted)."""
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - best effort; the kill below is what counts
            self.engine = None
        self.engine_module.kill_process_tree(os.getpid(), include_parent=False)

    def stop(self) -> dict[str, Any]:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        return {}


def _serve(cmd_fd: int, resp_fd: int) -> int:
    cmds = os.fdopen(cmd_fd, "r")
    resp = os.fdopen(resp_fd, "w")

    def answer(record: dict[str, Any]) -> None:
        resp.write(json.dumps(record, default=str) + "\n")
        resp.flush()

    try:
        driver = Driver()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    answer({"ok": True, "ready": True, "method": driver.method})
    for line in cmds:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        processes_before = _EnvProcess.started
        try:
            if op == "start":
                result = driver.start(cmd["name"], cmd["args"], cmd.get("probe"), cmd.get("setup"),
                                      cmd.get("env"))
            elif op == "generate":
                result = driver.generate(cmd.get("prompt"), cmd["sampling"], cmd.get("input_ids"),
                                         bool(cmd.get("return_hidden_states")), bool(cmd.get("hidden_summary")),
                                         bool(cmd.get("raw_hidden_states")), cmd.get("image_data"))
            elif op == "flush":
                result = driver.flush()
            elif op == "rss":
                result = driver.rss()
            elif op in ("pause", "resume"):
                import signal

                result = driver.signal_engine(signal.SIGSTOP if op == "pause" else signal.SIGCONT)
            elif op == "stop":
                result = driver.stop()
            elif op == "exit":
                driver.stop()
                answer({"ok": True})
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 - the parent reports it with the log tail
            detail = traceback.format_exc()
            # Whether the Engine had started processes: after a start that did, the
            # next start in this driver has hung (the parent then opens a fresh one).
            started = _EnvProcess.started != processes_before or op != "start"
            driver.abandon()
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": detail,
                    "started_processes": started})
            continue
        answer({"ok": True, **result})
    driver.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.e2e.driver")
    p.add_argument("--cmd-fd", type=int, required=True)
    p.add_argument("--resp-fd", type=int, required=True)
    a = p.parse_args(argv)
    from harness.standins.cpu_engine import install

    install()  # already done by sitecustomize when HARNESS_CPU_ENGINE=1
    return _serve(a.cmd_fd, a.resp_fd)


if __name__ == "__main__":
    sys.exit(main())
