"""SGLang's own Triton kernels as references for the CPU stand-ins, run by Triton's
interpreter in this process (no GPU, no ``TRITON_INTERPRET`` at import)."""

from __future__ import annotations

import contextlib
import importlib

import pytest


@contextlib.contextmanager
def _lang_interpreted():
    """The ``triton.language`` helpers a kernel calls (``tl.cdiv``, ...) are themselves
    ``@triton.jit`` functions: interpreted too while the reference runs."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name in ("triton.experimental.gluon.language",):  # imports that check the helpers' type
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    saved = {}
    for module in (tl, getattr(tl, "standard", None)):
        if module is None:
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                saved[(module, key)] = value
                setattr(module, key, InterpretedFunction(value.fn))
    try:
        yield
    finally:
        for (module, key), value in saved.items():
            setattr(module, key, value)


class _Interpreted:
    def __init__(self, kernel) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.fn = InterpretedFunction(kernel.fn)

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            with _lang_interpreted():
                return launch(*args, **kwargs)

        return run


@pytest.fixture(scope="session")
def interpreted():
    """``interpreted(kernel)[grid](*args)``: SGLang's Triton ``kernel`` run by Triton's
    interpreter on CPU tensors."""
    pytest.importorskip("triton")
    return _Interpreted


# The child of ``engine_process``: SGLang's CPU engine mode first, then each module's
# ``ENGINE_CHECK`` in its own namespace; a check leaves its result in ``out``.
_ENGINE_CHILD = """
import json, sys, traceback
from harness.standins.cpu_engine import install
install()
checks = json.loads(sys.stdin.read())
report = {}
for name, code in checks:
    ns = {"__name__": "engine_check_" + name}
    try:
        exec(compile(code, name + ".ENGINE_CHECK", "exec"), ns)
        report[name] = {"out": ns["out"]}
    except BaseException:
        report[name] = {"error": traceback.format_exc()}
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="session")
def engine_process(request):
    """``engine_process(module_name)``: the result (``out``) of that test module's
    ``ENGINE_CHECK``, run in one fresh interpreter in SGLang's CPU engine mode together
    with the other collected stand-in modules' checks, in ``ENGINE_CHECK_ORDER``
    (default 5). SGLang decides its platform at import, so each check needs a process
    that never imported it; one such process for all of them costs one SGLang import
    instead of four (about 40 s of CPU each on 0.5.23). The tests that use it share one
    xdist group, so one worker runs it. A check that raised fails its own test only."""
    import json
    import os
    import subprocess
    import sys

    from harness import ROOT

    modules = {}
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "ENGINE_CHECK"):
            modules[module.__name__] = module
    ordered = sorted(modules.values(), key=lambda m: (getattr(m, "ENGINE_CHECK_ORDER", 5), m.__name__))
    checks = [(m.__name__, m.ENGINE_CHECK) for m in ordered]
    # The repo and its tests/standins first; the SGLang tree under test
    # ($HARNESS_SGLANG_PATH, put on PYTHONPATH by tests/conftest.py) stays.
    path = [str(ROOT), str(ROOT / "tests" / "standins"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run([sys.executable, "-c", _ENGINE_CHILD], input=json.dumps(checks), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    report = json.loads(lines[-1][len("REPORT "):]) if lines else {}

    def result(name: str):
        if name not in report:
            pytest.fail(f"the CPU engine process (exit {proc.returncode}) ran no check "
                        f"{name}:\n{proc.stderr[-3000:]}")
        if "error" in report[name]:
            pytest.fail(f"{name}.ENGINE_CHECK raised in the CPU engine process:\n{report[name]['error']}")
        return report[name]["out"]

    return result
