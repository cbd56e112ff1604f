"""``harness.standins.cpu_engine.install()``: the post-import hooks, the sgl_kernel
stand-in (used only when the real package cannot load; refuses every op it lacks), the
per-module SGLang patches, the torch no-ops, and a child process started with
``child_env()`` (the ``sitecustomize`` route the Engine's processes take)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from harness import ROOT
from harness.standins.cpu_engine import child_env, hooks, sglang_patches

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter (cwd: the repo); it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- hooks ------------------------------------------------------------------------

def _write_module(tmp_path: Path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


def test_hook_runs_right_after_the_module_body(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, "hk_target", "VALUE = 1\ndef f():\n    return VALUE\n")
    _write_module(tmp_path, "hk_user", "from hk_target import VALUE\n")
    seen = []

    def hook(module):
        seen.append(module.VALUE)
        module.VALUE = 2

    hooks.when_imported("hk_target", hook)
    assert "hk_target" in hooks.pending()
    import hk_user  # noqa: F401  (imports hk_target: the hook runs before hk_user copies VALUE)

    assert seen == [1] and sys.modules["hk_user"].VALUE == 2
    target = sys.modules["hk_target"]
    assert type(target.__loader__).__name__ == "SourceFileLoader"  # the real loader is back
    assert target.__spec__.loader is target.__loader__
    assert "hk_target" not in hooks.pending()
    for name in ("hk_target", "hk_user"):
        sys.modules.pop(name)


def test_hook_on_an_imported_module_runs_at_once(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, "hk_done", "X = 0\n")
    import hk_done

    hooks.when_imported("hk_done", lambda m: setattr(m, "X", 5))
    assert hk_done.X == 5
    sys.modules.pop("hk_done")


def test_a_failing_hook_fails_the_import(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, "hk_bad", "X = 0\n")

    def hook(module):
        raise sglang_patches.StandinMismatch("hk_bad has moved on")

    hooks.when_imported("hk_bad", hook)
    with pytest.raises(sglang_patches.StandinMismatch, match="moved on"):
        import hk_bad  # noqa: F401
    sys.modules.pop("hk_bad", None)


# ---- per-module SGLang patches, on stand-in modules shaped like each base's --------

def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(textwrap.dedent(source), name, "exec"), module.__dict__)
    for value in module.__dict__.values():
        if isinstance(value, types.FunctionType):
            value.__module__ = name
    return module


PIN_EAGLE_UTILS = """
    import enum
    _is_cuda = False
    class TreeMaskMode(enum.IntEnum):
        FULL_MASK = 0
        QLEN_ONLY = 1
    def build_tree_kernel_efficient(*args):
        sgl_build_tree_kernel_efficient(*args)
    def verify_tree_greedy_func(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
        if _is_cuda:
            pass
        return predicts, accept_index, accept_token_num
"""

NEW_EAGLE_UTILS = """
    import enum
    _is_cpu = True
    class TreeMaskMode(enum.IntEnum):
        FULL_MASK = 0
        QLEN_ONLY = 1
    def default_tree_mask_mode():
        return TreeMaskMode.QLEN_ONLY if _is_cpu else TreeMaskMode.FULL_MASK
"""


def test_pin_eagle_utils_gets_the_tree_ops():
    import torch

    from harness.standins.cpu_engine import tree

    module = _module("fake.eagle_utils", PIN_EAGLE_UTILS)
    sglang_patches.patch_eagle_utils(module)
    assert module.sgl_build_tree_kernel_efficient is tree.build_tree_kernel_efficient
    assert module.__harness_cpu_engine__ == ("sgl_build_tree_kernel_efficient", "verify_tree_greedy_func")
    # the CPU branch now verifies (the original returned its inputs untouched)
    predicts = torch.full((3,), -1, dtype=torch.int32)
    accept_index = torch.full((1, 3), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    module.verify_tree_greedy_func(predicts, accept_index, accept_num, torch.tensor([[0, 4, 5]]),
                                   torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, -1]]), torch.full((1, 3), -1),
                                   torch.tensor([[4, 5, 6]]))
    assert accept_num.tolist() == [2] and predicts.tolist() == [4, 5, 6]


def test_new_eagle_utils_gets_full_mask():
    module = _module("fake.eagle_utils", NEW_EAGLE_UTILS)
    assert module.default_tree_mask_mode() == module.TreeMaskMode.QLEN_ONLY
    sglang_patches.patch_eagle_utils(module)
    assert module.default_tree_mask_mode() == module.TreeMaskMode.FULL_MASK


def test_a_module_without_a_known_gap_is_refused():
    module = _module("fake.eagle_utils", "_is_cpu = True\ndef verify_tree_greedy_func():\n    return _is_cpu\n")
    with pytest.raises(sglang_patches.StandinMismatch, match="fake.eagle_utils"):
        sglang_patches.patch_eagle_utils(module)


def test_pin_cache_locs_gets_a_cpu_branch():
    import torch

    module = _module("fake.cache_locs", """
        _is_cuda = False
        def assign_extend_cache_locs_func(req_pool_indices, req_to_token, start_offset, end_offset,
                                          batch_size, draft_token_num, device):
            if _is_cuda:
                return 1
    """)
    sglang_patches.patch_cache_locs(module)
    out = module.assign_extend_cache_locs_func(torch.tensor([1]), torch.arange(16, dtype=torch.int32).view(2, 8),
                                               torch.tensor([2]), torch.tensor([5]), 1, 3, "cpu")
    assert out.dtype == torch.int64 and out.tolist() == [10, 11, 12]


def test_parallel_state_turns_pynccl_off_over_gloo():
    module = _module("fake.parallel_state", """
        def init_model_parallel_group(group_ranks, local_rank, backend, use_pynccl=None, group_name=None):
            return backend, use_pynccl, group_name
    """)
    sglang_patches.patch_parallel_state(module)
    assert module.init_model_parallel_group([[0, 1]], 0, "gloo", group_name="tp") == ("gloo", False, "tp")
    # what a caller chose, and another backend, stay as they were
    assert module.init_model_parallel_group([[0, 1]], 0, "gloo", use_pynccl=True) == ("gloo", True, None)
    assert module.init_model_parallel_group([[0, 1]], 0, backend="nccl") == ("nccl", None, None)


# ---- the sgl_kernel stand-in, in fresh interpreters ---------------------------------

STANDIN_PROBE = """
    import json, sys
    from harness.standins.cpu_engine import sgl_kernel_module
    sgl_kernel_module.install_finder()
    import sgl_kernel
    out = {"standin": sgl_kernel_module.is_standin(sgl_kernel), "reason": getattr(sgl_kernel, "__standin_reason__", ""),
           "ops": sorted(n for n in sgl_kernel_module.OPS if hasattr(sgl_kernel, n)),
           "left": sorted(m for m in sys.modules if m.startswith("sgl_kernel."))}
    try:
        from sgl_kernel import fused_experts_cpu  # noqa: F401
    except ImportError as exc:
        out["missing_op"] = str(exc)
    try:
        import sgl_kernel.mamba  # noqa: F401
    except ImportError as exc:
        out["submodule"] = str(exc)
    try:
        sgl_kernel.rmsnorm_cpu
    except AttributeError as exc:
        out["attribute"] = str(exc)
    print(json.dumps(out))
"""


def _env_with(path: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path) if path else None, str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_standin_when_the_real_package_cannot_load(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "version.py").write_text("__version__ = '9'\n")
    (pkg / "__init__.py").write_text("from sgl_kernel.version import __version__\n"
                                     "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    out = _run(STANDIN_PROBE, _env_with(tmp_path))
    assert out["standin"] is True
    assert "libcuda.so.1" in out["reason"]
    assert out["ops"] == sorted(__import__("harness.standins.cpu_engine.sgl_kernel_module", fromlist=["OPS"]).OPS)
    assert out["left"] == []                      # the half-imported real submodules are gone
    assert "fused_experts_cpu" in out["missing_op"]
    assert "not a package" in out["submodule"]
    assert "rmsnorm_cpu" in out["attribute"] and "stand in" in out["attribute"]


def test_the_real_package_when_it_loads(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    out = _run(textwrap.dedent(STANDIN_PROBE) + "print(json.dumps({'real': sgl_kernel.REAL}))\n",
               _env_with(tmp_path))
    assert out == {"real": True}


def test_standin_when_no_package_is_installed():
    out = _run("""
        import importlib.machinery, importlib.util, json
        from harness.standins.cpu_engine import sgl_kernel_module as m
        spec = importlib.machinery.ModuleSpec("sgl_kernel", m._Loader(None))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(json.dumps({"reason": module.__standin_reason__, "has": hasattr(module, "verify_tree_greedy_cpu")}))
    """, _env_with(None))
    assert out == {"reason": "no sgl_kernel package is installed", "has": True}


# ---- torch, child processes, and SGLang itself -------------------------------------

def test_torch_no_ops_and_a_child_started_with_child_env():
    out = _run("""
        import json, os
        from harness.standins import cpu_engine
        import torch
        t = torch.ones(2)
        t.record_stream(torch.cpu.current_stream())   # torch refuses this without the stand-in
        if not torch.cuda.is_available():
            torch.cuda.synchronize(); torch.cuda.empty_cache()
        print(json.dumps({"installed": cpu_engine.installed(), "cpu": os.environ.get("SGLANG_USE_CPU_ENGINE"),
                          "interp": os.environ.get("TRITON_INTERPRET")}))
    """, child_env())
    assert out == {"installed": True, "cpu": "1", "interp": "1"}


# Run in the stand-ins' shared CPU engine process (conftest.py's ``engine_process``): a
# fresh interpreter whose first act is ``install()``; a second call changes nothing.
ENGINE_CHECK = """
import importlib, json, sys, torch
from harness.standins.cpu_engine import install, sglang_patches, sgl_kernel_module
install(); install()
for name in sglang_patches.HOOKS:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not name.startswith(exc.name or "?"):
            raise
import sgl_kernel
out = {"applied": sglang_patches.applied(), "standin": sgl_kernel_module.is_standin(),
       "sync": torch.cuda.synchronize.__module__}
"""
ENGINE_CHECK_ORDER = 0


@pytest.mark.xdist_group("engine-process")
def test_install_in_a_fresh_process_fills_this_bases_gaps(engine_process):
    from harness.patchset.layout import layout

    out = engine_process(__name__)
    pool = "sglang.srt.mem_cache.memory_pool"
    eagle = "sglang.srt.speculative.eagle_utils"
    assert out["applied"].pop("sglang.srt.distributed.parallel_state") == [
        "init_model_parallel_group: use_pynccl=False over gloo"]
    if layout().label == "0.5.13.post1":
        assert out["applied"] == {
            eagle: ["sgl_build_tree_kernel_efficient", "verify_tree_greedy_func"],
            "sglang.srt.speculative.triton_ops.cache_locs": ["assign_extend_cache_locs_func"],
            pool: ["copy_all_layer_kv_cache_tiled"],
        }
    else:
        assert out["applied"][eagle] == ["default_tree_mask_mode"]
        assert out["applied"][pool] == ["none needed: copy_all_layer_kv_cache_func calls sgl_kernel's CPU op"]
    assert out["standin"] is True
    assert out["sync"] == "harness.standins.cpu_engine.torch_cpu"


def test_install_after_sglang_is_refused():
    code = ("import sys, types\nsys.modules['sglang.srt.utils'] = types.ModuleType('sglang.srt.utils')\n"
            "from harness.standins.cpu_engine import install\ninstall()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "must run before SGLang is imported" in proc.stderr
    assert "sglang.srt.utils" in proc.stderr
