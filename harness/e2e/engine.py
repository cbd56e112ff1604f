"""The parent side of the Engine driver: one driver process per session, one Engine at
a time in it, every case of a configuration sent through the same Engine.

``Session`` starts ``python -m harness.e2e.driver`` in a process group of its own, with
``harness.standins.cpu_engine.child_env()`` (the CPU engine mode in every process it
starts) and its output in a log file. Every command has a deadline; a command that
misses it, or a driver that dies, ends the session: the whole process group is killed
and the error names the engine, the model and the base, with the log's tail (where the
scheduler's traceback lands). ``close()`` always kills the group.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import ROOT

# Deadlines against hangs, not expectations: on 2 idle cores the driver is ready in about
# a minute, an engine starts in 10-30 s and a generate takes 2-30 s; a busy machine is
# several times slower.
READY_TIMEOUT = float(os.environ.get("HARNESS_E2E_READY_TIMEOUT", "600"))
START_TIMEOUT = float(os.environ.get("HARNESS_E2E_START_TIMEOUT", "600"))
GENERATE_TIMEOUT = float(os.environ.get("HARNESS_E2E_GENERATE_TIMEOUT", "600"))
TAIL_LINES = 40


class EngineError(RuntimeError):
    """One engine failed: start, generate, or the driver itself. ``answer``: the driver's
    failure answer, when it gave one (None when it died or missed a deadline)."""

    answer: dict | None = None


@dataclass(frozen=True)
class EngineConfig:
    """One Engine: what it serves and how (``key`` identifies it for reuse)."""

    key: str                      # e.g. "llama-eagle3-exact"
    model: str                    # family, for messages
    target: str                   # checkpoint path
    draft: str | None = None
    algorithm: str | None = None  # None (plain), "EAGLE3", "DFLASH"
    topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int = 4
    extra: tuple[tuple[str, Any], ...] = ()
    # "module:function" hooks run in every process the Engine starts (the driver's
    # HARNESS_E2E_SETUP): CPU stand-ins for kernels the family needs that have no CPU path.
    setup: tuple[str, ...] = ()
    # Environment variables for this Engine's processes (e.g. SGLANG_CPU_OMP_THREADS_BIND).
    env: tuple[tuple[str, str], ...] = ()

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = dict(
            model_path=self.target,
            device="cpu",
            dtype="float32",  # bf16 under the Triton interpreter gives wrong tokens
            attention_backend="triton",  # the EAGLE worker refuses torch_native
            sampling_backend="pytorch",
            disable_cuda_graph=True,
            disable_radix_cache=True,
            chunked_prefill_size=-1,
            # The KV budget is (available after load) - (available before) * (1 - this);
            # other processes' allocations in between count against it, so leave room.
            # max_total_tokens keeps the pools tiny whatever the budget.
            mem_fraction_static=0.5,
            max_total_tokens=2048,
            max_running_requests=4,
            skip_server_warmup=True,
            random_seed=0,
            log_level=os.environ.get("HARNESS_E2E_LOG_LEVEL", "warning"),
        )
        if self.algorithm == "EAGLE3":
            args.update(
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=self.draft,
                speculative_num_steps=self.num_steps,
                speculative_eagle_topk=self.topk,
                speculative_num_draft_tokens=self.num_draft_tokens,
            )
        elif self.algorithm == "DFLASH":
            args.update(
                speculative_algorithm="DFLASH",
                speculative_draft_model_path=self.draft,
                speculative_num_draft_tokens=self.num_draft_tokens,
            )
        elif self.algorithm is not None:
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        args.update(dict(self.extra))
        return args


@dataclass
class Session:
    """A driver process and the Engine it currently runs."""

    workdir: Path
    base: str
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    current: EngineConfig | None = None
    timings: list[tuple[str, str, float]] = field(default_factory=list)
    _cmd: Any = None
    _resp: Any = None
    _buf: bytes = b""
    _log: Path | None = None
    _starts: int = 0
    last_generate_s: float = 0.0

    # -- process ---------------------------------------------------------------------

    def open(self) -> None:
        from harness.standins.cpu_engine import child_env

        self.workdir.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        self._log = self.workdir / f"driver-{self._starts}.log"
        env = child_env(self.env)
        env.setdefault("TORCHDYNAMO_DISABLE", "1")  # torch.compile'd helpers run eagerly (same result, no C++ builds)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd_r, cmd_w = os.pipe()
        resp_r, resp_w = os.pipe()
        log = open(self._log, "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.e2e.driver", "--cmd-fd", str(cmd_r), "--resp-fd", str(resp_w)],
                cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(cmd_r, resp_w), start_new_session=True,
            )
        finally:
            log.close()
            os.close(cmd_r)
            os.close(resp_w)
        self._cmd = os.fdopen(cmd_w, "w")
        self._resp = resp_r
        atexit.register(self._kill)  # a parent that dies without close() leaves no engine behind
        t0 = time.monotonic()
        self._receive(READY_TIMEOUT, "start the engine driver (import SGLang)")
        self.timings.append(("driver", "ready", time.monotonic() - t0))

    def close(self) -> None:
        """Ask the driver to exit, then kill its process group whatever it did."""
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self._cmd is not None:
                self._cmd.write(json.dumps({"op": "exit"}) + "\n")
                self._cmd.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        self._kill()

    def _kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self._cmd,):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self._resp is not None:
            try:
                os.close(self._resp)
            except OSError:
                pass
        self.proc, self._cmd, self._resp, self.current = None, None, None, None

    # -- protocol --------------------------------------------------------------------

    def tail(self, n: int = TAIL_LINES) -> str:
        if self._log is None or not self._log.exists():
            return "(no log)"
        lines = self._log.read_text(errors="replace").splitlines()
        keep = [ln for ln in lines if ln.strip()]
        return "\n".join(keep[-n:])

    def _last_exception(self) -> str | None:
        """The last ``SomethingError: ...`` line of the log (the scheduler's, mostly)."""
        if self._log is None or not self._log.exists():
            return None
        found = None
        for line in self._log.read_text(errors="replace").splitlines():
            head = line.strip().split(":", 1)[0]
            if head.endswith(("Error", "Exception")) and head.replace(".", "").replace("_", "").isalnum() and ":" in line:
                found = line.strip()
        return found[:300] if found else None

    def _what(self) -> str:
        cfg = self.current
        who = f"engine {cfg.key} ({cfg.model}" + (f", {cfg.algorithm}" if cfg.algorithm else ", plain") + ")" if cfg else "engine driver"
        return f"{who} on SGLang {self.base}"

    def _fail(self, message: str, detail: str = "", kill: bool = True) -> EngineError:
        """The error for the current engine; ``kill``: the driver is past saving (a
        deadline passed, it died), so its process group goes."""
        text = f"{self._what()}: {message}"
        cause = self._last_exception()
        if cause and cause not in message:
            text += f" [log: {cause}]"
        if detail:
            text += f"\n--- error ---\n{detail.rstrip()}"
        text += f"\n--- driver/scheduler log tail ({self._log}) ---\n{self.tail()}"
        if kill:
            self._kill()
        else:
            self.current = None  # the driver cleaned up; the next ensure() starts afresh
        return EngineError(text)

    def _receive(self, timeout: float, doing: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"timed out after {timeout:.0f} s waiting to {doing}")
            ready, _, _ = select.select([self._resp], [], [], min(left, 1.0))
            if not ready:
                if self.proc is not None and self.proc.poll() is not None:
                    raise self._fail(f"driver exited with {self.proc.returncode} while waiting to {doing}")
                continue
            chunk = os.read(self._resp, 1 << 20)
            if not chunk:
                code = self.proc.wait(timeout=10) if self.proc is not None else None
                raise self._fail(f"driver exited ({code}) while waiting to {doing}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer = json.loads(line)
        if not answer.get("ok"):
            error = self._fail(f"failed to {doing}: {answer.get('error')}", answer.get("traceback", ""), kill=False)
            error.answer = answer
            raise error
        return answer

    def _call(self, cmd: dict[str, Any], timeout: float, doing: str) -> dict[str, Any]:
        if self.proc is None:
            self.open()
        try:
            self._cmd.write(json.dumps(cmd) + "\n")
            self._cmd.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"driver gone ({exc}) before it could {doing}")
        return self._receive(timeout, doing)

    # -- engines ---------------------------------------------------------------------

    def ensure(self, config: EngineConfig, probe: Path | None = None) -> None:
        """Run ``config``'s Engine (reusing it when it already runs)."""
        if self.current == config:
            return
        if self.proc is None:
            self.open()
        self.current = config
        try:
            answer = self._call({"op": "start", "name": config.key, "args": config.engine_args(),
                                 "probe": str(probe) if probe else None, "setup": list(config.setup),
                                 "env": dict(config.env)}, START_TIMEOUT, "start")
        except EngineError as exc:
            # A start that failed after the Engine started processes (a scheduler that
            # died loading the model) has left the driver unable to start the next one
            # (seen: that start hung to its deadline): the next ensure() opens a fresh
            # driver. A refusal before any process started (SGLang's argument checks)
            # keeps it.
            if exc.answer is None or exc.answer.get("started_processes", True):
                self._kill()
            raise
        self.timings.append((config.key, "start", float(answer.get("start_s", 0.0))))

    def generate(self, prompt: str | list[str] | None, sampling: dict[str, Any] | list[dict[str, Any]],
                 timeout: float = GENERATE_TIMEOUT, *, input_ids: list | None = None,
                 return_hidden_states: bool = False, hidden_summary: bool = False,
                 raw_hidden_states: bool = False, image_data: list | None = None) -> list[dict[str, Any]]:
        """One ``Engine.generate`` of ``prompt`` (text) or ``input_ids`` (tokens; one
        request or a list of them; ``sampling`` one for all or one each), each output's
        ``meta_info["hidden_states"]`` kept with ``return_hidden_states`` (with
        ``hidden_summary``: only ``hidden_rows``, ``hidden_width`` and ``hidden_sha256``;
        ``raw_hidden_states``: asked for as one tensor per request, kept as
        ``hidden_states_raw``, ``harness.e2e.driver.raw_record``). ``image_data``: one image
        path (or None) per request, as ``Engine.generate`` takes it.
        ``last_generate_s``: the driver's wall time of the ``Engine.generate`` call."""
        if self.current is None:
            raise EngineError("no engine is running")
        cmd: dict[str, Any] = {"op": "generate", "prompt": prompt, "sampling": sampling}
        if input_ids is not None:
            cmd["input_ids"] = input_ids
        if return_hidden_states:
            cmd["return_hidden_states"] = True
        if hidden_summary:
            cmd["hidden_summary"] = True
        if raw_hidden_states:
            cmd["return_hidden_states"] = cmd["raw_hidden_states"] = True
        if image_data is not None:
            cmd["image_data"] = image_data
        answer = self._call(cmd, timeout, "generate")
        self.last_generate_s = float(answer.get("generate_s", 0.0))
        self.timings.append((self.current.key, "generate", self.last_generate_s))
        return answer["outputs"]

    def flush(self) -> None:
        """The Engine's radix cache emptied (``Engine.flush_cache``)."""
        if self.current is None:
            raise EngineError("no engine is running")
        answer = self._call({"op": "flush"}, GENERATE_TIMEOUT, "flush the cache")
        if not answer.get("flushed"):
            raise EngineError(f"{self.current.key}: flush_cache() refused")

    def pause(self) -> None:
        """Stop the Engine's processes (SIGSTOP) until ``resume()``: an idle SGLang
        scheduler spins, taking cores from whatever else runs."""
        self._call({"op": "pause"}, GENERATE_TIMEOUT, "pause the engine")

    def resume(self) -> None:
        self._call({"op": "resume"}, GENERATE_TIMEOUT, "resume the engine")

    def rss(self) -> dict[str, int]:
        """Peak RSS so far: ``engine_peak_rss_bytes`` (the largest of the Engine's
        processes) and ``driver_peak_rss_bytes``."""
        if self.current is None:
            raise EngineError("no engine is running")
        return self._call({"op": "rss"}, GENERATE_TIMEOUT, "read peak RSS")
