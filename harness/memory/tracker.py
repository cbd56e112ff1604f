"""Peak memory trackers: exact live-storage bytes on CPU, the CUDA allocator's peak on GPU.

``LiveStorageTracker`` is a ``TorchDispatchMode`` (after PyTorch's
``torch/distributed/_tools/mem_tracker.py``): every tensor an op returns is mapped to its
untyped storage; a storage that none of the op's inputs already held is a new
allocation and is counted once, with its exact ``nbytes()``, until a
``weakref.finalize`` on the (PyObject-preserved) storage fires when it is freed. So:

* views (``x[1:]``, ``view``, ``t()``...) share their input's storage: nothing counted;
* in-place ops (``add_``), ``copy_`` into an existing buffer and ``out=`` return one of
  their inputs: nothing counted (unless they grow a tracked storage, which is updated);
* storages alive at entry (the baseline) are never counted: only outputs can add bytes;
* ``current_bytes`` falls when a tracked storage dies; ``peak_bytes`` is the maximum of
  ``current_bytes`` seen at op boundaries (kernel-internal workspaces are invisible).

``CudaPeakTracker`` has the same API over ``torch.cuda.memory_allocated`` /
``max_memory_allocated`` (relative to the allocated bytes at entry, after an optional
warm-up); the caching allocator rounds each block up (512 B granularity), so compare
GPU numbers with a tolerance. ``make_tracker(device)`` picks one.

Stdlib-only at import time (torch is imported when a tracker is built).
"""

from __future__ import annotations

import threading
import weakref
import contextlib
from typing import Any, Callable

__all__ = ["LiveStorageTracker", "CudaPeakTracker", "make_tracker", "untracked"]


def _dispatch_mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def _iter_tensors(obj: Any):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


def _storage(t: Any):
    try:
        return t.untyped_storage()
    except Exception:  # sparse / nested / no storage
        return None


class _Tracker:
    """Lazily-built TorchDispatchMode subclass (torch is imported on first use)."""

    _cls: type | None = None

    @classmethod
    def get(cls) -> type:
        if cls._cls is not None:
            return cls._cls
        base = _dispatch_mode_base()

        class LiveStorageTrackerImpl(base):  # type: ignore[misc, valid-type]
            def __init__(self, device: str | None = "cpu") -> None:
                super().__init__()
                import torch

                self.device_type = None if device is None else torch.device(device).type
                self._lock = threading.Lock()
                self._live: dict[int, int] = {}  # storage _cdata -> counted nbytes
                self.current_bytes = 0
                self.peak_bytes = 0
                self.n_allocs = 0
                self.total_allocated_bytes = 0

            # --- accounting -------------------------------------------------
            def _on_free(self, key: int) -> None:
                with self._lock:
                    nbytes = self._live.pop(key, None)
                    if nbytes is not None:
                        self.current_bytes -= nbytes

            def _track(self, st: Any) -> None:
                key = st._cdata
                nbytes = st.nbytes()
                with self._lock:
                    old = self._live.get(key)
                    if old is None:
                        self._live[key] = nbytes
                        self.current_bytes += nbytes
                        self.n_allocs += 1
                        self.total_allocated_bytes += nbytes
                        weakref.finalize(st, self._on_free, key)
                    elif old != nbytes:  # a tracked storage was resized (resize_, out=)
                        self._live[key] = nbytes
                        self.current_bytes += nbytes - old
                        self.total_allocated_bytes += max(0, nbytes - old)
                    self.peak_bytes = max(self.peak_bytes, self.current_bytes)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                input_keys = set()
                for t in _iter_tensors((args, kwargs)):
                    st = _storage(t)
                    if st is not None:
                        input_keys.add(st._cdata)
                out = func(*args, **kwargs)
                for t in _iter_tensors(out):
                    if self.device_type is not None and t.device.type != self.device_type:
                        continue
                    st = _storage(t)
                    if st is None:
                        continue
                    key = st._cdata
                    if key in input_keys and key not in self._live:
                        continue  # aliases an input (view / in-place / out=): baseline or known
                    self._track(st)
                return out

            # --- API --------------------------------------------------------
            def reset_peak(self) -> None:
                with self._lock:
                    self.peak_bytes = self.current_bytes

            @property
            def live_storages(self) -> int:
                return len(self._live)

            def __repr__(self) -> str:
                return (f"LiveStorageTracker(device={self.device_type!r}, current={self.current_bytes}, "
                        f"peak={self.peak_bytes}, allocs={self.n_allocs})")

        LiveStorageTrackerImpl.__doc__ = """``with LiveStorageTracker("cpu") as t: ...``; then ``t.peak_bytes``,
        ``t.current_bytes``, ``t.reset_peak()``, ``t.n_allocs``, ``t.total_allocated_bytes``.

        Bytes are exact untyped-storage sizes, over the baseline of storages alive at
        entry. ``device=None`` counts storages on every device.
        """
        LiveStorageTrackerImpl.__module__ = __name__
        LiveStorageTrackerImpl.__name__ = "LiveStorageTracker"
        LiveStorageTrackerImpl.__qualname__ = "LiveStorageTracker"
        cls._cls = LiveStorageTrackerImpl
        return LiveStorageTrackerImpl


def __getattr__(name: str) -> Any:
    # ``LiveStorageTracker`` subclasses TorchDispatchMode, so it is built on first access
    # (keeps ``import harness.memory.tracker`` stdlib-only).
    if name == "LiveStorageTracker":
        return _Tracker.get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CudaPeakTracker:
    """Same API as :func:`LiveStorageTracker`, from the CUDA caching allocator's counters.

    On entry: run ``warmup`` (if given), synchronize, record ``memory_allocated`` as the
    baseline and ``reset_peak_memory_stats``. ``peak_bytes`` / ``current_bytes`` are
    relative to that baseline (block-rounded by the allocator).
    """

    def __init__(self, device: Any = "cuda", warmup: Callable[[], Any] | None = None) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaPeakTracker needs a cuda device, got {self.device}")
        self._warmup = warmup
        self.baseline = 0
        self._peak_snapshot: int | None = None
        self._current_snapshot: int | None = None
        self._active = False

    def _sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def __enter__(self) -> "CudaPeakTracker":
        import torch

        if self._warmup is not None:
            self._warmup()
        self._sync()
        self.baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_snapshot = self._current_snapshot = None
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._peak_snapshot = self.peak_bytes
        self._active = False

    @property
    def current_bytes(self) -> int:
        import torch

        self._sync()
        return torch.cuda.memory_allocated(self.device) - self.baseline

    @property
    def peak_bytes(self) -> int:
        import torch

        if not self._active and self._peak_snapshot is not None:
            return self._peak_snapshot
        self._sync()
        return torch.cuda.max_memory_allocated(self.device) - self.baseline

    def reset_peak(self) -> None:
        import torch

        self._sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_snapshot = None

    def __repr__(self) -> str:
        return f"CudaPeakTracker(device={self.device}, baseline={self.baseline})"


def make_tracker(device: Any = "cpu", warmup: Callable[[], Any] | None = None) -> Any:
    """``CudaPeakTracker`` for a cuda device, else an exact ``LiveStorageTracker``."""
    import torch

    if torch.device(device).type == "cuda":
        return CudaPeakTracker(device, warmup=warmup)
    if warmup is not None:
        warmup()
    return _Tracker.get()(str(torch.device(device).type))


@contextlib.contextmanager
def untracked():
    """Allocations inside are invisible to an active :func:`LiveStorageTracker`: for a
    stand-in's own compute, which a measured model does not own (a whole-layer stand-in
    on the real residual stream, where only the model's capture path is measured)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
