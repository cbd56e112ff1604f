"""Peak memory of a whole model's capture path: the pin's list against the packer.

A list-capturing model family (llama) is measured before and after the series, side
by side in one process: the pristine ``llama.py`` of the active base (the pin, or
0.5.23 with ``HARNESS_BASE``; read from that release's verified wheel and loaded under
a module name of its own, so it runs against the same SGLang; the result's ``pin``
key) and the patched one, each as a tiny real ``LlamaModel`` with CPU stand-ins. For each,
two exact live-storage peaks: the capture path's (the captures the forward hands over
plus what the logits processor's ``pack_aux_hidden_states`` adds: 2 x K*T*H*itemsize
for a list, 1 x packed), and the whole forward + pack, with and without captures
(in a tiny model the forward's own activations can hide the cat spike; in a real one
the logits processor runs after them).
"""

from __future__ import annotations

import dataclasses
import linecache
import sys
import types
import zipfile
from typing import Any, Dict, Sequence

PIN_MODULE = "sglang.srt.models._auxcap_pin_{name}"


def pin_module(name: str):
    """The pristine pin's ``sglang/srt/models/<name>.py`` as a module of its own."""
    from harness.patchset.apply import fetch_wheel
    from harness.patchset.layout import layout
    from harness.patchset.pin import load_pin

    mod_name = PIN_MODULE.format(name=name)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    lay = layout()
    wheel = fetch_wheel(lay, load_pin(lay))
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(f"sglang/srt/models/{name}.py").decode()
    module = types.ModuleType(mod_name)
    module.__file__ = f"{wheel}/sglang/srt/models/{name}.py"
    # Its source for inspect (Triton's @jit reads the kernels it defines): the path
    # lies inside the wheel, so linecache holds it (mtime None: checkcache keeps it).
    linecache.cache[module.__file__] = (len(source), None, source.splitlines(True), module.__file__)
    module.__package__ = "sglang.srt.models"
    sys.modules[mod_name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def _peak(model, spec, tokens: int, layers: Sequence[int], device: str) -> tuple[int, int]:
    """(peak bytes over baseline of forward + pack, bytes the capture path holds at its
    peak: the captures the forward returns plus what packing them adds)."""
    import torch
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    from harness.memory.tracker import make_tracker
    from harness.standins.batch import make_forward_batch

    spec.configure(model, layers)
    ids = torch.randint(1, spec.tiny.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    positions = torch.arange(tokens, dtype=torch.int64, device=device)

    def forward():
        with torch.no_grad():
            out = spec.run(model, ids, positions, make_forward_batch(ids))
        return out if isinstance(out, tuple) else (out, None)

    def run():
        hidden, aux = forward()
        return hidden, None if aux is None else pack_aux_hidden_states(aux)

    try:
        with make_tracker(device, warmup=run if device != "cpu" else None) as tracker:
            result = run()
        del result
        whole = int(tracker.peak_bytes)
        hidden, aux = forward()
        if aux is None:
            return whole, 0
        return whole, capture_path_bytes(aux, device)
    finally:
        spec.configure(model, [])


def held_bytes(aux) -> int:
    """Bytes of the distinct storages a forward's captures live in (a list of tensors,
    or one packed tensor)."""
    import torch

    parts = [aux] if isinstance(aux, torch.Tensor) else list(aux)
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in parts}.values())


def capture_path_bytes(aux, device: str = "cpu") -> int:
    """What the capture path holds at its peak: the captures a forward returned (held)
    plus what ``pack_aux_hidden_states`` adds to hand them to the draft. List + cat:
    2 x K*T*H*itemsize; the packer: 1 x."""
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    from harness.memory.tracker import make_tracker

    with make_tracker(device) as tracker:
        packed = pack_aux_hidden_states(aux)
    del packed
    return held_bytes(aux) + int(tracker.peak_bytes)


def model_capture_peaks(
    family: str, tokens: int, hidden: int, layers: Sequence[int], dtype: str = "bfloat16",
    device: str = "cpu",
) -> Dict[str, Any]:
    """Peak bytes over baseline of the pin's and the patched model, with and without
    captures; ``extra`` = with - without, what capturing costs."""
    import torch

    from harness.standins.models import build, specs

    base = specs()[family]
    tiny = dataclasses.replace(base.tiny, hidden_size=hidden, dtype=dtype)
    out: Dict[str, Any] = {"family": family, "tokens": tokens, "hidden": hidden,
                           "k": len(layers), "dtype": dtype, "device": device}
    itemsize = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    out["capture_bytes"] = len(layers) * tokens * hidden * itemsize
    for variant, module in (("pin", pin_module(base.module.rsplit(".", 1)[1]).__name__),
                            ("patched", base.module)):
        spec = dataclasses.replace(base, name=f"{family}@{variant}", module=module, tiny=tiny)
        model = build(spec, tiny)
        with_captures, capture_path = _peak(model, spec, tokens, layers, device)
        without, _ = _peak(model, spec, tokens, [], device)
        out[variant] = {"capture_path_peak_bytes": capture_path,
                        "forward_peak_bytes": with_captures,
                        "forward_peak_without_captures_bytes": without,
                        "returns": "list" if variant == "pin" else "packed"}
        del model
    out["ratio_patched_over_pin"] = (
        out["patched"]["capture_path_peak_bytes"] / out["pin"]["capture_path_peak_bytes"]
        if out["pin"]["capture_path_peak_bytes"] else None
    )
    return out


__all__ = ["pin_module", "model_capture_peaks", "held_bytes", "capture_path_bytes"]
