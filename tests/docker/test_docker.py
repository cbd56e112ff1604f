"""Offline checks of the Docker tooling: Dockerfile layout, engine/base/build error paths,
the GPU image entrypoint, and applying the series onto an existing checkout.

Nothing here needs a Docker engine: the docker client is a fake script.
"""

from __future__ import annotations

import collections
import json
import re
import stat
import subprocess
from pathlib import Path

import pytest

from harness import ROOT, HarnessError
from harness.docker import base as hb
from harness.docker import engine as hd
from harness.docker import image as hdt
from harness.docker import inside as hi
from harness.patchset.git import git
from harness.patchset.layout import layout

DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"

pytestmark = pytest.mark.skipif(not DOCKERFILE.exists(), reason="docker/ not in this tree")


def _stages(text: str) -> dict[str, list[str]]:
    """{stage name: [instruction lines]} with continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    stages: dict[str, list[str]] = {}
    current = "_"
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^FROM\s+\S+\s+AS\s+(\S+)$", line, re.I)
        if m:
            current = m.group(1)
        stages.setdefault(current, []).append(line)
    return stages


def _index(lines: list[str], pattern: str) -> int:
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            return i
    raise AssertionError(f"no line matching {pattern!r}")


def test_dockerfile_cpu_layer_order() -> None:
    st = _stages(DOCKERFILE.read_text())
    assert {"cpu-deps", "cpu", "gpu"} <= set(st)
    deps = st["cpu-deps"]
    # the deps layer is keyed only on the lock: nothing else is copied into that stage
    copies = [x for x in deps if x.startswith("COPY")]
    assert [c.split()[1] for c in copies] == ["requirements/tools.txt", "requirements/test.lock"]
    assert _index(deps, r"COPY requirements/test.lock") < _index(deps, r"uv pip sync .*--require-hashes")
    cpu = st["cpu"]
    order = [
        r"^COPY \.cache/pypi/",
        r"^COPY harness/",
        r"^COPY patches/",
        r"harness apply-patches",
        r"^COPY tests/",
    ]
    idx = [_index(cpu, p) for p in order]
    assert idx == sorted(idx), f"CPU stage out of order: {list(zip(order, idx))}"
    assert _index(cpu, r"^ARG SERIES_ID") > _index(cpu, r"^COPY patches/")
    assert any(re.search(r"LABEL org\.auxcap\.series-id=\"\$\{SERIES_ID\}\"", x) for x in cpu)
    assert any(x.startswith("ENTRYPOINT") and "entrypoint.sh" in x for x in cpu)
    # the patched wheel's version must carry the series id, checked at build time
    assert any("+auxcap.${SERIES_ID}" in x for x in cpu)


def test_dockerfile_no_registry_frontend_and_no_baked_ca() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M), "a syntax= frontend needs a registry"
    assert "ca-certificates.crt" not in re.sub(r"^#.*$", "", text, flags=re.M)
    # every RUN that touches the network reads the CA only through the secret mount
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if line.startswith("RUN") and ("--require-hashes" in line or "uv pip" in line):
            assert "--mount=type=secret,id=ca" in line, line[:80]
    gpu = _stages(text)["gpu"]
    assert any("harness.docker apply-onto" in x for x in gpu)
    assert any(re.search(r"pip install .*--no-deps .*-e ", x) for x in gpu)


def test_dockerignore_allowlists_every_copy_source() -> None:
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    entries = [x.strip() for x in ignore if x.strip() and not x.startswith("#")]
    assert entries[0] == "*"
    allowed = [e[1:].rstrip("/") for e in entries if e.startswith("!")]
    for line in re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines():
        if not line.startswith("COPY") or "--from" in line:
            continue
        for src in line.split()[1:-1]:
            src = src.replace("${PRISTINE_WHEEL}", "sglang-x.whl").rstrip("*").rstrip("/")
            assert any(src == a or src.startswith(a + "/") or re.fullmatch(a.replace("*", ".*"), src) for a in allowed), src


def test_lock_subset(tmp_path: Path) -> None:
    lock = tmp_path / "test.lock"
    lock.write_text(
        "# header\n"
        "pytest==9.2.0 \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n    # via -r test.in\n"
        "torch==2.11.0 \\\n    --hash=sha256:cc\n"
        "pluggy==1.7.0 \\\n    --hash=sha256:dd\n"
    )
    out = hi.lock_subset(lock, ["pytest", "Pluggy"])
    assert out == "pytest==9.2.0 \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\npluggy==1.7.0 \\\n    --hash=sha256:dd\n"
    with pytest.raises(HarnessError, match="no pin for execnet"):
        hi.lock_subset(lock, ["pytest", "execnet"])


def test_recipe_hash_is_stable_and_covers_packages() -> None:
    h = hb.recipe_hash()
    assert h == hb.recipe_hash() and len(h) == 16
    other = json.loads(json.dumps(hb.BASE_RECIPE))
    other["packages"] = other["packages"] + ["build-essential"]
    assert hb.recipe_hash(other) != h


def test_check_disk_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(hd.shutil, "disk_usage", lambda p: usage(100e9, 97e9, 3e9))
    with pytest.raises(HarnessError) as exc:
        hd.check_disk(tmp_path / "missing" / "deeper", 25, "the CPU image")
    msg = str(exc.value)
    assert "\n" not in msg and "3.0 GB free" in msg and "need 25 GB" in msg


def _fake_exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_ensure_engine_not_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hd, "find_client", lambda: hd.Docker("docker", buildx=False))
    monkeypatch.setattr(hd, "engine_up", lambda c: False)
    monkeypatch.setattr(hd.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    with pytest.raises(HarnessError, match=r"no Docker engine is running and this is not root|permission denied"):
        hd.ensure_engine(layout(tmp_path))
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    with pytest.raises(HarnessError, match=r"DOCKER_HOST=tcp://127.0.0.1:9 does not answer"):
        hd.ensure_engine(layout(tmp_path))


def test_ensure_engine_reports_dockerd_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dockerd = _fake_exe(
        tmp_path / "dockerd",
        'echo \'time="x" level=fatal msg="failed to start daemon: no overlay for you"\'\nexit 1\n',
    )
    monkeypatch.setattr(hd, "find_client", lambda: hd.Docker("docker", buildx=False))
    monkeypatch.setattr(hd, "engine_up", lambda c: False)
    monkeypatch.setattr(hd.os, "geteuid", lambda: 0)
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    real_which = hd.shutil.which
    monkeypatch.setattr(hd.shutil, "which", lambda n, **k: str(dockerd) if n == "dockerd" else real_which(n, **k))
    with pytest.raises(HarnessError) as exc:
        hd.ensure_engine(layout(tmp_path), install=False)
    msg = str(exc.value)
    assert "dockerd exited with code 1" in msg and "no overlay for you" in msg and "build/dockerd.log" in msg
    assert (tmp_path / "build" / "dockerd.log").exists()


def test_ensure_engine_no_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hd, "find_client", lambda: None)
    monkeypatch.setattr(hd.os, "geteuid", lambda: 0)
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setattr(hd.shutil, "which", lambda n, **k: None)
    monkeypatch.setattr(hd.os, "access", lambda p, m: False)
    with pytest.raises(HarnessError, match=r"apt-get install docker.io"):
        hd.ensure_engine(layout(tmp_path), install=False)


def test_failed_build_leaves_no_tag(tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    docker = _fake_exe(
        tmp_path / "docker",
        f'echo "$*" >> {calls}\n'
        'case "$1" in build)\n'
        '  echo "#7 [cpu 5/9] RUN set -eu; python -m harness apply-patches"\n'
        '  echo "#7 0.512 applying 0002-foo.patch"\n'
        '  echo "#7 0.611 error: 0002-foo.patch: python/sglang/x.py: hunk #1 does not apply"\n'
        '  echo "#7 ERROR: process \\"/bin/sh -c set -eu\\" did not complete successfully: exit code: 1"\n'
        "  exit 1;;\n"
        "esac\nexit 0\n",
    )
    lay = layout(tmp_path)
    (tmp_path / "build").mkdir()
    client = hd.Docker(str(docker), buildx=False)
    with pytest.raises(HarnessError) as exc:
        hdt.build_image(client, lay, "auxcap/cpu:abc", "abc", tmp_path / "w.whl", no_cache=False)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "[cpu 5/9]" in msg and "0002-foo.patch: python/sglang/x.py: hunk #1 does not apply" in msg
    log = calls.read_text().splitlines()
    assert not any(x.startswith("tag ") for x in log), log
    assert any(x.startswith("image rm auxcap/cpu:abc-build") for x in log)


def test_build_as_the_first_command_makes_build_dir(tmp_path: Path) -> None:
    """On a fresh clone nothing has made build/ yet: the build log must not need it."""
    docker = _fake_exe(
        tmp_path / "docker",
        'case "$1" in\n'
        '  build) echo "#5 [cpu 1/9] FROM base"; echo "#5 DONE 0.1s"; exit 0;;\n'
        '  image) [ "$2" = inspect ] && echo \'{"org.auxcap.series-id": "abc"}\'; exit 0;;\n'
        "esac\nexit 0\n",
    )
    lay = layout(tmp_path)
    assert not lay.build.exists()
    hdt.build_image(hd.Docker(str(docker), buildx=False), lay, "auxcap/cpu:abc", "abc",
                    tmp_path / "w.whl", no_cache=False)
    assert (lay.build / "docker-build.log").read_text().startswith("#5 [cpu 1/9]")


def test_docker_test_needs_the_lock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HARNESS_ROOT", str(tmp_path))
    p = __import__("argparse").ArgumentParser()
    hdt.add_arguments(p)
    with pytest.raises(HarnessError, match=r"requirements/test.lock missing"):
        hdt.run(p.parse_args([]))


# ---------------------------------------------------------------- entrypoint


def _run_entrypoint(tmp_path: Path, *args: str, nvidia_rc: int | None, cuda: bool = False) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_rc is not None:
        _fake_exe(bin_dir / "nvidia-smi", f"exit {nvidia_rc}\n")
    # fake python: torch.cuda probe answers `cuda`; `-m harness ...` echoes its args
    _fake_exe(
        bin_dir / "python3",
        'if [ "$1" = -c ]; then exit ' + ("0" if cuda else "1") + '; fi\necho "harness-ran $*"\n',
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "AUXCAP_HOME": str(tmp_path), "AUXCAP_IMAGE_KIND": "gpu"}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True)


def test_gpu_entrypoint_without_gpu_says_so(tmp_path: Path) -> None:
    proc = _run_entrypoint(tmp_path, nvidia_rc=None)  # default verb in the GPU image: test-gpu
    assert proc.returncode == 3
    assert "needs a GPU, but none is visible" in proc.stderr and "--gpus all" in proc.stderr
    assert "harness-ran" not in proc.stdout
    proc = _run_entrypoint(tmp_path, "test-gpu", nvidia_rc=0, cuda=False)
    assert proc.returncode == 3 and "torch.cuda.is_available() is False" in proc.stderr
    proc = _run_entrypoint(tmp_path, "test-gpu", "-k", "x", nvidia_rc=0, cuda=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "harness-ran -m harness test-gpu -k x"


def test_cpu_verbs_need_no_gpu(tmp_path: Path) -> None:
    proc = _run_entrypoint(tmp_path, "test", nvidia_rc=None)
    assert proc.returncode == 0 and "harness-ran -m harness test" in proc.stdout


# ---------------------------------------------------------------- apply-onto


def _checkout_with_series(tmp_path: Path) -> tuple[Path, Path]:
    """(checkout at the 'pin' commit, harness root whose series changes it)."""
    co = tmp_path / "sglang"
    (co / "python" / "sglang").mkdir(parents=True)
    mod = co / "python" / "sglang" / "mod.py"
    mod.write_text("".join(f"line_{i} = {i}\n" for i in range(1, 21)))
    git(co, "init", "-q", "-b", "main")
    git(co, "add", "-A")
    git(co, "commit", "-q", "-m", "pin")
    pin_commit = git(co, "rev-parse", "HEAD").stdout.strip()
    mod.write_text(mod.read_text().replace("line_10 = 10\n", "line_10 = 100\n"))
    git(co, "commit", "-q", "-am", "Change line 10\n\nPatch-Id: ten")
    root = tmp_path / "root"
    (root / "patches").mkdir(parents=True)
    git(co, "format-patch", "-q", "-1", "-o", str(root / "patches"))
    git(co, "reset", "-q", "--hard", pin_commit)
    names = sorted(p.name for p in (root / "patches").glob("*.patch"))
    (root / "patches" / "series").write_text("# test series\n" + "\n".join(names) + "\n")
    pin = {"package": "sglang", "version": "0.5.13.post1", "git": {"tag": "v0.5.13.post1", "commit": pin_commit}, "wheels": {}}
    (root / "patches" / "pin.json").write_text(json.dumps(pin))
    return co, root


def test_apply_onto_checkout(tmp_path: Path) -> None:
    co, root = _checkout_with_series(tmp_path)
    applied = hi.apply_onto(co, layout(root), series_id="abc123")
    assert len(applied) == 1
    assert "line_10 = 100\n" in (co / "python" / "sglang" / "mod.py").read_text()
    assert git(co, "log", "-1", "--format=%s").stdout.strip().endswith("Change line 10")
    assert git(co, "rev-parse", "auxcap/abc123").returncode == 0


def test_apply_onto_refuses_wrong_base_dirty_tree_and_bad_hunk(tmp_path: Path) -> None:
    co, root = _checkout_with_series(tmp_path)
    mod = co / "python" / "sglang" / "mod.py"
    # another commit on top: HEAD is not the pinned commit
    mod.write_text(mod.read_text().replace("line_2 = 2\n", "line_2 = 22\n"))
    git(co, "commit", "-q", "-am", "other")
    with pytest.raises(HarnessError, match=r"HEAD is [0-9a-f]{40}, pin.json wants"):
        hi.apply_onto(co, layout(root))
    git(co, "reset", "-q", "--hard", "HEAD~1")
    mod.write_text(mod.read_text() + "dirty = 1\n")
    with pytest.raises(HarnessError, match=r"local changes"):
        hi.apply_onto(co, layout(root))
    # a base whose line 10 differs: the hunk does not apply; error names patch + file
    mod.write_text(mod.read_text().replace("dirty = 1\n", "").replace("line_10 = 10\n", "line_10 = 7\n"))
    git(co, "commit", "-q", "-am", "drift")
    with pytest.raises(HarnessError) as exc:
        hi.apply_onto(co, layout(root), allow_base_mismatch=True)
    msg = str(exc.value)
    assert "\n" not in msg and ".patch" in msg and "python/sglang/mod.py" in msg
    assert not (co / ".git" / "rebase-apply").exists()  # am aborted, tree left usable
