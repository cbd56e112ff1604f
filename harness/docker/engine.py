"""The Docker engine: a BuildKit-capable client and a running ``dockerd``.

:func:`ensure_engine` finds them; as root on Debian it installs ``docker.io`` and starts
``dockerd`` (log: build/dockerd.log). Also the small helpers every docker verb uses: a
disk-space check and a per-stage timer. Stdlib only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import HarnessError, progress
from harness.patchset.layout import Layout, layout

DOCKER_ROOT = Path("/var/lib/docker")
ENGINE_START_TIMEOUT = 90.0


# ---------------------------------------------------------------- small helpers


def check_disk(path: Path, need_gb: float, what: str) -> None:
    """Fail with one line when the filesystem holding ``path`` has < ``need_gb`` free."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < need_gb:
        raise HarnessError(
            f"not enough disk for {what}: {free_gb:.1f} GB free on {probe}, need {need_gb:.0f} GB "
            "(free space, e.g. `docker system prune`, or pass --min-free-gb)"
        )


def _fmt(seconds: float) -> str:
    return f"{seconds:6.1f}s" if seconds < 120 else f"{seconds / 60:5.1f}m"


@dataclass
class Timer:
    """Per-stage wall-clock timings, printed as a table at the end."""

    stages: list[tuple[str, float]] = field(default_factory=list)

    def run(self, name: str, fn, *a, **kw):  # type: ignore[no-untyped-def]
        progress(f"==> {name}")
        t0 = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.monotonic() - t0
            self.stages.append((name, dt))
            progress(f"<== {name}: {_fmt(dt).strip()}")

    def report(self) -> None:
        if not self.stages:
            return
        width = max(len(n) for n, _ in self.stages)
        progress("timings:")
        for name, dt in self.stages:
            progress(f"  {name:<{width}}  {_fmt(dt)}")
        progress(f"  {'total':<{width}}  {_fmt(sum(dt for _, dt in self.stages))}")


# ---------------------------------------------------------------- engine


@dataclass(frozen=True)
class Docker:
    """A docker client that can build with BuildKit, talking to a running engine."""

    exe: str
    buildx: bool  # True: `docker buildx build`; False: DOCKER_BUILDKIT=1 `docker build`

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["DOCKER_BUILDKIT"] = "1"
        env.setdefault("BUILDKIT_PROGRESS", "plain")
        return env

    def cmd(self, *args: str) -> list[str]:
        return [self.exe, *args]

    def build_cmd(self, *args: str) -> list[str]:
        return [self.exe, "buildx", "build", "--load", *args] if self.buildx else [self.exe, "build", *args]

    def run(self, *args: str, check: bool = False, timeout: float | None = 60) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                self.cmd(*args), env=self.env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise HarnessError(f"`docker {args[0]}` timed out after {timeout:.0f}s") from None
        if check and proc.returncode != 0:
            msg = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
            raise HarnessError(f"docker {' '.join(args[:2])} failed: {msg}")
        return proc

    def image_labels(self, ref: str) -> dict[str, str] | None:
        """Labels of a local image, or None when there is no such image."""
        proc = self.run("image", "inspect", "--format", "{{json .Config.Labels}}", ref)
        if proc.returncode != 0:
            return None
        try:
            return json.loads(proc.stdout.strip() or "null") or {}
        except json.JSONDecodeError:
            return {}


def _client_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_client() -> Docker | None:
    """A client that can do BuildKit builds (needed for RUN --mount / --secret).

    Docker CLI >= 23 builds only through the buildx plugin; older clients (Debian
    bookworm's docker.io 20.10) drive the engine's built-in BuildKit with
    DOCKER_BUILDKIT=1.
    """
    seen: set[str] = set()
    for cand in (os.environ.get("AUXCAP_DOCKER"), shutil.which("docker"), "/usr/bin/docker"):
        if not cand or not os.access(cand, os.X_OK):
            continue
        real = os.path.realpath(cand)
        if real in seen:
            continue
        seen.add(real)
        try:
            bx = subprocess.run([cand, "buildx", "version"], capture_output=True, text=True, timeout=20)
            if bx.returncode == 0 and "buildx" in (bx.stdout + bx.stderr).lower():
                return Docker(cand, buildx=True)
        except (OSError, subprocess.TimeoutExpired):
            continue
        ver = _client_version(cand)
        if ver is not None and ver < (23,):
            return Docker(cand, buildx=False)
    return None


def engine_up(client: Docker) -> bool:
    try:
        proc = subprocess.run(
            client.cmd("info", "--format", "{{.ServerVersion}}"),
            env=client.env, capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


def _apt_install(packages: list[str], why: str) -> None:
    if os.geteuid() != 0:
        raise HarnessError(f"{why}: not root, so cannot apt-get install {' '.join(packages)}; install it and retry")
    if not shutil.which("apt-get"):
        raise HarnessError(f"{why}: no apt-get here; install {' '.join(packages)} and retry")
    progress(f"  {why}: apt-get install -y {' '.join(packages)} (one-time)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = []
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log.append(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "?").splitlines()[-1]
            raise HarnessError(f"{why}: `{' '.join(cmd[:2])}` failed: {last}")


def ensure_engine(lay: Layout | None = None, install: bool = True) -> Docker:
    """Return a BuildKit-capable client with a running engine, starting one if we may."""
    lay = lay or layout()
    client = find_client()
    if client is not None and engine_up(client):
        return client
    if os.environ.get("DOCKER_HOST"):
        raise HarnessError(f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer `docker info`; start that engine or unset DOCKER_HOST")
    if os.geteuid() != 0:
        sock = "/var/run/docker.sock"
        if os.path.exists(sock) and not os.access(sock, os.R_OK | os.W_OK):
            raise HarnessError(f"cannot use the Docker engine at {sock}: permission denied (join the docker group or run as root)")
        raise HarnessError(
            "no Docker engine is running and this is not root, so none can be started: "
            "start dockerd (e.g. `sudo dockerd &`) or set DOCKER_HOST, then retry"
        )
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if os.access("/usr/sbin/dockerd", os.X_OK) else None)
    if dockerd is None or client is None:
        if not install:
            raise HarnessError("no Docker engine here: apt-get install docker.io (or drop --no-install)")
        _apt_install(["docker.io"], "no Docker engine")
        dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
        client = find_client()
        if client is None:
            raise HarnessError("docker.io installed but no BuildKit-capable client found (need /usr/bin/docker < 23 or the buildx plugin)")
    if engine_up(client):
        return client
    lay.build.mkdir(parents=True, exist_ok=True)
    log_path = lay.build / "dockerd.log"
    progress(f"  starting dockerd in the background (log: {lay.rel(log_path)})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [dockerd], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    (lay.build / "dockerd.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HarnessError(
                f"dockerd exited with code {proc.returncode} while starting: {_last_error(log_path)} "
                f"(full log: {lay.rel(log_path)})"
            )
        if engine_up(client):
            progress(f"  dockerd is up (pid {proc.pid})")
            return client
        time.sleep(1.0)
    raise HarnessError(
        f"dockerd did not answer within {ENGINE_START_TIMEOUT:.0f}s: {_last_error(log_path)} (log: {lay.rel(log_path)})"
    )


def _last_error(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines[-200:]):
        if "level=fatal" in line or "level=error" in line or line.startswith("failed"):
            m = re.search(r'msg="([^"]*)"', line)
            return m.group(1) if m else line.strip()
    return lines[-1].strip() if lines else "empty log"


# ---------------------------------------------------------------- base image
