"""torch calls SGLang makes unconditionally, made harmless where there is no GPU.

- ``torch.cuda.synchronize()`` / ``torch.cuda.empty_cache()``: SGLang calls them on
  every device (the pin's ``LlamaForCausalLM.set_embed``, which EAGLE3 uses to share
  the target's embedding). Without a CUDA device there is nothing to wait for or to
  free, so they return None; with one they are torch's own.
- ``Tensor.record_stream(stream)``: the overlap scheduler records its CPU tensors on
  ``torch.cpu.current_stream()``, which torch refuses ("unknown parameter type"). A CPU
  tensor is not managed by a caching stream allocator, so recording it is a no-op;
  any other tensor goes to torch's own.
"""

from __future__ import annotations

from types import ModuleType

_MARK = "__harness_cpu_engine__"


def patch(torch: ModuleType) -> None:
    """Apply the three, once per process."""
    if getattr(torch, _MARK, False):
        return
    setattr(torch, _MARK, True)
    if not torch.cuda.is_available():
        def synchronize(device=None) -> None:
            """No CUDA device here: nothing to wait for (harness.standins.cpu_engine)."""

        def empty_cache() -> None:
            """No CUDA device here: nothing to free (harness.standins.cpu_engine)."""

        torch.cuda.synchronize = synchronize
        torch.cuda.empty_cache = empty_cache

    record_stream = torch.Tensor.record_stream

    def record_stream_cpu_noop(self, stream):
        if self.device.type == "cpu":
            return None
        return record_stream(self, stream)

    record_stream_cpu_noop.__doc__ = record_stream.__doc__
    torch.Tensor.record_stream = record_stream_cpu_noop
