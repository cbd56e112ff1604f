"""``docker-test``: build the CPU image from the series and run the CPU suites inside it.

Stages (each timed): Docker engine (installed/started if needed and allowed), the
Debian base image (``docker-base``), the pristine pin wheel in .cache/pypi, the image
build (``docker/Dockerfile`` target ``cpu``, tagged ``auxcap/cpu:<series id>``), and
``docker run IMAGE test`` with build/results/docker mounted as the image's
build/results (JUnit XML, memory tables).

The build goes to a temporary tag that is renamed only on success, so the final tag
never names a half-built image. Stdlib only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from harness import HarnessError, progress
from harness.docker.base import BASE_IMAGE, ensure_base
from harness.docker.engine import DOCKER_ROOT, Docker, Timer, check_disk, ensure_engine
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin, pin_wheel
from harness.patchset.series import series_id

IMAGE_REPO = "auxcap/cpu"
DOCKERFILE = "docker/Dockerfile"
# The image with the locked SGLang env is ~10 GB; the build needs room for it, BuildKit's
# uv cache (~4 GB) and the layer being committed.
DEFAULT_MIN_FREE_GB = 20.0  # ~11 GB image + layer export headroom
CA_CANDIDATES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tag", help=f"image tag (default: {IMAGE_REPO}:<series id>)")
    p.add_argument("--no-run", action="store_true", help="build the image only")
    p.add_argument("--no-build", action="store_true", help="run the existing image only")
    p.add_argument("--no-cache", action="store_true", help="build without BuildKit's layer cache")
    p.add_argument("--no-install", action="store_true", help="never apt-get install docker.io / debootstrap")
    p.add_argument("--verb", default="test", help="harness verb the container runs (default: test)")
    p.add_argument("--shm-size", default="4g", help="container /dev/shm (gloo ranks share tensors there; default 4g)")
    p.add_argument(
        "--min-free-gb", type=float, default=float(os.environ.get("AUXCAP_DOCKER_MIN_FREE_GB", DEFAULT_MIN_FREE_GB)),
        help=f"refuse to build with less free disk than this (default {DEFAULT_MIN_FREE_GB:.0f})",
    )
    p.add_argument("--results", type=Path, help="host folder for results (default build/results/docker)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the verb inside the container (after --)")


def ca_bundle() -> str | None:
    for cand in (os.environ.get("SSL_CERT_FILE"), *CA_CANDIDATES):
        if cand and os.path.isfile(cand) and os.path.getsize(cand) > 0:
            return cand
    return None


def ensure_pristine_wheel(lay: Layout) -> Path:
    """The pinned cp311 wheel, hash-checked, in .cache/pypi (the build context)."""
    pin = load_pin(lay)
    try:
        from harness.patchset.apply import fetch_wheel
    except ImportError:
        fetch_wheel = None
    if fetch_wheel is not None:
        path = fetch_wheel(lay, pin, "cp311")
    else:  # tooling not there yet: only accept a cached file with the pinned hash
        from harness.patchset.pypi import sha256_file

        name, sha = pin_wheel(pin, "cp311")
        path = lay.cache / name
        if not path.exists() or sha256_file(path) != sha:
            raise HarnessError(f"{lay.rel(path)}: missing or not the pinned wheel; run `make apply-patches` first")
    default_cache = lay.root / ".cache" / "pypi"
    if path.parent.resolve() != default_cache.resolve():
        # HARNESS_CACHE points elsewhere: the build context only sees .cache/pypi.
        default_cache.mkdir(parents=True, exist_ok=True)
        dest = default_cache / path.name
        if not dest.exists():
            shutil.copy2(path, dest)
        path = dest
    progress(f"  {lay.rel(path)} (sha256 checked)")
    return path


_STEP_RE = re.compile(r"^#(\d+) \[([^\]]+)\] (.*)$")
_DONE_RE = re.compile(r"^#(\d+) (DONE [\d.]+s|CACHED)$")
_ERR_RE = re.compile(r"^#(\d+) ERROR: (.*)$")
_OUT_RE = re.compile(r"^#(\d+) [\d.]+ (.*)$")


def build_image(client: Docker, lay: Layout, tag: str, sid: str, wheel: Path, no_cache: bool) -> None:
    tmp_tag = f"{tag}-build{os.getpid()}"
    log_path = lay.build / "docker-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)  # the first command on a fresh clone
    cmd = client.build_cmd(
        "-f", str(lay.root / DOCKERFILE),
        "--target", "cpu",
        "--network", "host",
        "--progress", "plain",
        "--build-arg", f"CPU_BASE={BASE_IMAGE}",
        "--build-arg", f"SERIES_ID={sid}",
        "--build-arg", f"PRISTINE_WHEEL={wheel.name}",
        "-t", tmp_tag,
    )
    ca = ca_bundle()
    if ca:
        cmd += ["--secret", f"id=ca,src={ca}"]
    if no_cache:
        cmd += ["--no-cache"]
    cmd.append(str(lay.root))
    progress(f"  docker build --target cpu -> {tag} (log: {lay.rel(log_path)})")
    steps: dict[str, str] = {}
    last_out: dict[str, list[str]] = {}
    failed: tuple[str, str] | None = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=lay.root, env=client.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            line = line.rstrip("\n")
            if m := _STEP_RE.match(line):
                steps[m.group(1)] = f"[{m.group(2)}] {m.group(3)}"
            elif m := _DONE_RE.match(line):
                desc = steps.get(m.group(1))
                if desc and "[internal]" not in desc and "load " not in desc:
                    short = desc if len(desc) < 100 else desc[:97] + "..."
                    progress(f"    {m.group(2):>11}  {short}")
            elif m := _ERR_RE.match(line):
                failed = failed or (m.group(1), m.group(2))
            elif m := _OUT_RE.match(line):
                buf = last_out.setdefault(m.group(1), [])
                buf.append(m.group(2))
                del buf[:-40]
            elif line.startswith(("error:", "ERROR:", "failed to solve")) and failed is None:
                failed = ("", line)
        rc = proc.wait()
    if rc != 0:
        client.run("image", "rm", tmp_tag)
        step, why = failed or ("", f"exit {rc}")
        where = steps.get(step, "")
        errs = [x for x in last_out.get(step, []) if x.lstrip().lower().startswith(("error", "×", "fatal"))]
        detail = errs[-1].strip() if errs else why.strip()
        where_s = f" at {where[:80]}" if where else ""
        raise HarnessError(f"docker build failed{where_s}: {detail[:300]} (log: {lay.rel(log_path)})")
    client.run("tag", tmp_tag, tag, check=True)
    client.run("image", "rm", tmp_tag)
    labels = client.image_labels(tag) or {}
    if labels.get("org.auxcap.series-id") != sid:
        raise HarnessError(f"{tag}: label org.auxcap.series-id={labels.get('org.auxcap.series-id')!r}, expected {sid}")
    progress(f"  built {tag}")


def run_tests(client: Docker, lay: Layout, tag: str, verb: str, args: list[str], results: Path, shm: str) -> int:
    if results.exists():
        shutil.rmtree(results)
    results.mkdir(parents=True)
    cmd = client.cmd(
        "run", "--rm", "--network", "none", "--shm-size", shm,
        "-v", f"{results.resolve()}:/opt/auxcap/build/results",
        tag, verb, *(["--"] if args and args[0].startswith("-") else []), *args,
    )
    progress("+ " + " ".join(cmd[1:]))
    rc = subprocess.run(cmd, env=client.env, stdin=subprocess.DEVNULL).returncode
    files = sorted(p for p in results.rglob("*") if p.is_file())
    progress(f"  results in {lay.rel(results)}: " + (", ".join(p.name for p in files) if files else "none"))
    return rc


def run(args: argparse.Namespace) -> int:
    lay = layout()
    timer = Timer()
    extra = list(args.args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    lock = lay.root / "requirements" / "test.lock"
    if not args.no_build and not lock.exists():
        raise HarnessError("requirements/test.lock missing: run `make lock` first")
    sid = series_id(lay)
    tag = args.tag or f"{IMAGE_REPO}:{sid}"
    results = args.results or (lay.results / "docker")
    progress(f"series {sid}: image {tag}")
    rc = 0
    t0 = time.monotonic()
    try:
        client = timer.run("docker engine", ensure_engine, lay, install=not args.no_install)
        if not args.no_build:
            have = client.image_labels(tag)
            timer.run("base image", ensure_base, client, lay)
            wheel = timer.run("pristine wheel", ensure_pristine_wheel, lay)
            root = DOCKER_ROOT if DOCKER_ROOT.exists() else lay.build
            need = args.min_free_gb if have is None else min(args.min_free_gb, 5.0)
            check_disk(root, need, f"the CPU image {tag}")
            timer.run("image build", build_image, client, lay, tag, sid, wheel, args.no_cache)
        elif client.image_labels(tag) is None:
            raise HarnessError(f"no image {tag}: drop --no-build")
        if not args.no_run:
            rc = timer.run(f"{args.verb} in container", run_tests, client, lay, tag, args.verb, extra, results, args.shm_size)
    finally:
        timer.report()
    if rc != 0:
        progress(f"docker-test: `{args.verb}` in {tag} exited {rc} (results: {lay.rel(results)})")
    else:
        progress(f"docker-test: ok in {time.monotonic() - t0:.0f}s")
    return rc
