"""``docker-base``: the Debian bookworm / Python 3.11 base image, built locally.

No container registry is reachable, so the base comes from Debian's packages:
``debootstrap --variant=minbase bookworm`` into a scratch folder, then
``tar -C rootfs -c . | docker import - auxcap/debian-py311:bookworm``. The image carries
the hash of its recipe as a label and is rebuilt only when the recipe changes.

Also here, shared with ``docker-test`` and the GPU image:

- :func:`ensure_engine`: find a BuildKit-capable docker client and a running engine;
  as root on Debian, install ``docker.io`` and start ``dockerd`` (log: build/dockerd.log).
- :func:`apply_onto`: apply ``patches/series`` onto an existing SGLang git checkout (the
  one inside ``lmsysorg/sglang``) with the tooling's zero-fuzz ``git am --no-3way``.
  ``python -m harness.docker apply-onto DIR`` runs it inside ``docker build``.

Stdlib only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import HarnessError
from harness.common import Layout, layout, progress

BASE_IMAGE = "auxcap/debian-py311:bookworm"
RECIPE_LABEL = "org.auxcap.base-recipe"
# What uv, torch on CPU and git need; uv itself comes from PyPI in the Dockerfile.
# g++ + Python headers: SGLang's CPU paths hit torch.compile, whose inductor builds C++
# (with Python.h) at run time ("InvalidCxxCompiler" without them).
BASE_RECIPE: dict[str, object] = {
    "recipe": 2,
    "suite": "bookworm",
    "variant": "minbase",
    "mirror": "http://deb.debian.org/debian",
    "packages": ["ca-certificates", "g++", "git", "libpython3.11-dev", "python3.11", "python3.11-venv"],
    "env": ["LANG=C.UTF-8"],
}
BASE_MIN_FREE_GB = 3.0
DOCKER_ROOT = Path("/var/lib/docker")
ENGINE_START_TIMEOUT = 90.0


# ---------------------------------------------------------------- small helpers


def recipe_hash(recipe: dict[str, object] | None = None) -> str:
    blob = json.dumps(recipe or BASE_RECIPE, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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


def ensure_base(client: Docker, lay: Layout | None = None, force: bool = False, min_free_gb: float = BASE_MIN_FREE_GB) -> bool:
    """Build BASE_IMAGE unless it exists with the same recipe hash. True when built."""
    lay = lay or layout()
    want = recipe_hash()
    labels = client.image_labels(BASE_IMAGE)
    if labels is not None and labels.get(RECIPE_LABEL) == want and not force:
        progress(f"  {BASE_IMAGE} is current (recipe {want})")
        return False
    if labels is not None:
        progress(f"  {BASE_IMAGE} has recipe {labels.get(RECIPE_LABEL) or 'none'}, want {want}: rebuilding")
    if os.geteuid() != 0:
        raise HarnessError("debootstrap needs root: run `python -m harness docker-base` as root")
    check_disk(lay.build, min_free_gb, "the base image (debootstrap)")
    debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
    if debootstrap is None:
        _apt_install(["debootstrap", "debian-archive-keyring"], "no debootstrap")
        debootstrap = shutil.which("debootstrap", path="/usr/sbin:/sbin:/usr/bin") or "debootstrap"
    lay.build.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="docker-base.", dir=lay.build))
    rootfs = scratch / "rootfs"
    cache = lay.root / ".cache" / "debootstrap"
    cache.mkdir(parents=True, exist_ok=True)
    log_path = lay.build / "docker-base.log"
    r = BASE_RECIPE
    cmd = [
        debootstrap,
        f"--variant={r['variant']}",
        f"--cache-dir={cache}",
        str(r["suite"]), str(rootfs), str(r["mirror"]),
    ]
    try:
        progress(f"  debootstrap {r['suite']} ({r['variant']}) -> {lay.rel(rootfs)}")
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise HarnessError(f"debootstrap failed (exit {proc.returncode}): {_tail_line(log_path)} (log: {lay.rel(log_path)})")
        # The packages go in with apt inside the chroot: it resolves their dependencies
        # fully (debootstrap --include does not, e.g. for python3.11-venv).
        shutil.copyfile("/etc/resolv.conf", rootfs / "etc/resolv.conf")
        progress(f"  apt-get install {' '.join(r['packages'])}")  # type: ignore[arg-type]
        with open(log_path, "a") as log:
            proc = subprocess.run(
                ["chroot", str(rootfs), "apt-get", "install", "-y", "-q", "--no-install-recommends", *r["packages"]],  # type: ignore[misc]
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH="/usr/sbin:/usr/bin:/sbin:/bin"),
            )
        if proc.returncode != 0:
            raise HarnessError(f"apt-get install in the base rootfs failed (exit {proc.returncode}): {_tail_line(log_path)} (log: {lay.rel(log_path)})")
        # Keep the image lean and free of host-specific state.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / sub).glob("*"):
                if p.is_file() and p.name != "lock":
                    p.unlink()
        for p in ("etc/hostname", "etc/resolv.conf"):
            (rootfs / p).unlink(missing_ok=True)
        progress(f"  docker import -> {BASE_IMAGE}")
        changes = [f"LABEL {RECIPE_LABEL}={want}", f"LABEL org.auxcap.base-suite={r['suite']}", 'CMD ["/bin/bash"]']
        changes += [f"ENV {e}" for e in r["env"]]  # type: ignore[union-attr]
        imp = [client.exe, "import"]
        for c in changes:
            imp += ["--change", c]
        # import to a temporary tag, then retag: the final tag never names a half image
        tmp_ref = f"{BASE_IMAGE}-tmp{os.getpid()}"
        imp += ["-", tmp_ref]
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            res = subprocess.run(imp, stdin=tar.stdout, env=client.env, capture_output=True, text=True)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar_rc = tar.wait()
        if tar_rc != 0 or res.returncode != 0:
            client.run("image", "rm", tmp_ref)
            why = f"tar exit {tar_rc}" if tar_rc else (res.stderr.strip() or f"exit {res.returncode}").splitlines()[-1]
            raise HarnessError(f"docker import of the base rootfs failed: {why}")
        client.run("tag", tmp_ref, BASE_IMAGE, check=True)
        client.run("image", "rm", tmp_ref)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    progress(f"  built {BASE_IMAGE} (recipe {want})")
    return True


def _tail_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    errs = [x for x in lines if x.startswith(("E:", "W: Failure", "E "))]
    return (errs or lines or ["empty log"])[-1].strip()


# ---------------------------------------------------------------- verb


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even if the image has the current recipe")
    p.add_argument("--no-install", action="store_true", help="never apt-get install docker.io / debootstrap")
    p.add_argument("--print-recipe", action="store_true", help="print the recipe and its hash, build nothing")


def run(args: argparse.Namespace) -> int:
    if args.print_recipe:
        print(json.dumps({"image": BASE_IMAGE, "hash": recipe_hash(), "recipe": BASE_RECIPE}, indent=2))
        return 0
    lay = layout()
    timer = Timer()
    try:
        client = timer.run("docker engine", ensure_engine, lay, install=not args.no_install)
        timer.run("base image", ensure_base, client, lay, force=args.force)
    finally:
        timer.report()
    return 0


# ---------------------------------------------------------------- apply onto a checkout


def apply_onto(tree: Path, lay: Layout | None = None, allow_base_mismatch: bool = False, series_id: str | None = None) -> list[str]:
    """Apply patches/series onto an existing SGLang git checkout (e.g. the GPU image's).

    Checks the checkout is clean and at the pinned commit (unless ``allow_base_mismatch``),
    then applies each patch with the tooling's zero-fuzz ``git am --no-3way``; a failure
    is one line naming the patch, file and hunk. Returns the applied patch names.
    """
    from harness.common import git, load_pin, read_series

    lay = lay or layout()
    tree = tree.resolve()
    if not (tree / ".git").exists():
        raise HarnessError(f"{tree}: not a git checkout (no .git)")
    pin = load_pin(lay)
    want = pin.get("git", {}).get("commit")
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if want and head != want:
        msg = f"{tree}: HEAD is {head}, pin.json wants {want} (tag {pin.get('git', {}).get('tag')})"
        if not allow_base_mismatch:
            raise HarnessError(msg + "; pass --allow-base-mismatch (ALLOW_BASE_MISMATCH=1) to apply anyway")
        progress(f"warning: {msg}; applying anyway")
    dirty = git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        first = dirty.splitlines()[0].strip()
        raise HarnessError(f"{tree}: checkout has local changes ({first} ...); the series needs a clean tree")
    names = read_series(lay)
    if not names:
        progress("patches/series lists no patches: nothing to apply")
        return []
    try:
        from harness.patchset import apply_one
    except ImportError:  # tooling not there: same semantics, coarser error
        apply_one = _apply_one_fallback
    for i, name in enumerate(names, 1):
        progress(f"  [{i}/{len(names)}] {name}")
        apply_one(tree, lay.patches / name)
    if series_id:
        git(tree, "tag", "-f", f"auxcap/{series_id}")
    progress(f"applied {len(names)} patch(es) onto {tree}")
    return names


def _apply_one_fallback(tree: Path, patch: Path) -> None:
    from harness.common import git

    if not patch.exists():
        raise HarnessError(f"{patch.name}: listed in series but missing")
    am = git(tree, "am", "--no-3way", str(patch), check=False)
    if am.returncode != 0:
        git(tree, "am", "--abort", check=False)
        out = am.stdout + am.stderr
        m = re.search(r"^error: patch failed: (.+):(\d+)$", out, re.M)
        where = f"{m.group(1)}: hunk at line {m.group(2)}" if m else "does not apply"
        raise HarnessError(f"{patch.name}: {where}")


def lock_subset(lock: Path, names: list[str]) -> str:
    """The blocks of a hashed lock file for ``names`` (for pip --require-hashes --no-deps)."""
    want = {n.lower().replace("_", "-") for n in names}
    out: list[str] = []
    keep = False
    found: set[str] = set()
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==", line)
        if m:
            name = m.group(1).lower().replace("_", "-")
            keep = name in want
            if keep:
                found.add(name)
        elif not line.startswith(" "):
            keep = False
        if keep and not line.lstrip().startswith("#"):
            out.append(line)
    missing = sorted(want - found)
    if missing:
        raise HarnessError(f"{lock}: no pin for {', '.join(missing)}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.docker apply-onto DIR | lock-subset LOCK NAME...`` (used in docker build)."""
    p = argparse.ArgumentParser(prog="python -m harness.docker")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply-onto", help="apply patches/series onto an existing SGLang git checkout")
    a.add_argument("tree", type=Path)
    a.add_argument("--allow-base-mismatch", action="store_true")
    a.add_argument("--series-id")
    s = sub.add_parser("lock-subset", help="print the hashed lock entries of the named packages")
    s.add_argument("lock", type=Path)
    s.add_argument("names", nargs="+")
    args = p.parse_args(argv)
    try:
        if args.cmd == "apply-onto":
            apply_onto(args.tree, allow_base_mismatch=args.allow_base_mismatch, series_id=args.series_id)
        else:
            sys.stdout.write(lock_subset(args.lock, args.names))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
