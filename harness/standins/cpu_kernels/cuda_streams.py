"""``torch.cuda.Stream()`` on a machine without CUDA: a CPU stream.

The pin's ``LongcatFlashModel.__init__`` creates its side stream unconditionally
(``self.alt_stream = torch.cuda.Stream()``, longcat_flash.py 522; 0.5.23 asks the runtime
context instead, ``get_stream("alt")``), so the model cannot even be built without a
CUDA driver. Every use of that stream is gated on CUDA-graph capture
(``get_is_capture_mode()``: deepseek_v2.py 840-843, forward_mla.py 166 and 239), which
never happens on the CPU: the stream only has to exist.

:func:`install` makes ``torch.cuda.Stream(...)`` return ``torch.cpu.Stream()`` (torch's
own no-op stream of the CPU device) while CUDA is unavailable; with CUDA it changes
nothing. Code that would use the stream on the CPU crashed before this at
construction; code that never constructs one is unaffected.

Stdlib-only at import time.
"""

from __future__ import annotations

from typing import Any

_SAVED: dict[str, Any] = {}


def install() -> None:
    """Idempotent; a no-op where CUDA is available."""
    import torch

    if torch.cuda.is_available() or "Stream" in _SAVED:
        return
    original = torch.cuda.Stream

    class Stream(torch.cpu.Stream):
        """A CPU stream in place of a CUDA one (harness.standins.cpu_kernels.cuda_streams)."""

        def __new__(cls, device=None, priority=0, **kwargs):
            return torch.cpu.Stream()

    _SAVED["Stream"] = original
    torch.cuda.Stream = Stream


def uninstall() -> None:
    import torch

    if "Stream" in _SAVED:
        torch.cuda.Stream = _SAVED.pop("Stream")
