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
