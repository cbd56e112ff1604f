"""``docker-base``: the Debian bookworm / Python 3.11 base image, built locally.

No container registry is reachable, so the base comes from Debian's packages:
``debootstrap --variant=minbase bookworm`` into a scratch folder, then
``tar -C rootfs -c . | docker import - auxcap/debian-py311:bookworm``. The image carries
the hash of its recipe as a label and is rebuilt only when the recipe changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import HarnessError, progress
from harness.docker.engine import Docker, Timer, _apt_install, check_disk, ensure_engine
from harness.patchset.layout import Layout, layout

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


def recipe_hash(recipe: dict[str, object] | None = None) -> str:
    blob = json.dumps(recipe or BASE_RECIPE, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
