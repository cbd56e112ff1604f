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
PIN_AUX = "sglang.srt.layers._auxcap_pin_aux_hidden_states"
AUX = "sglang.srt.layers.aux_hidden_states"


def _pristine_source(rel: str) -> tuple[str, str] | None:
    """(source, file name) of ``sglang/<rel>`` in the active base's verified wheel, or
    None where that release has no such file."""
    from harness.patchset.apply import fetch_wheel
    from harness.patchset.layout import layout
    from harness.patchset.pin import load_pin

    lay = layout()
    wheel = fetch_wheel(lay, load_pin(lay))
    with zipfile.ZipFile(wheel) as zf:
        if f"sglang/{rel}" not in zf.namelist():
            return None
        return zf.read(f"sglang/{rel}").decode(), f"{wheel}/sglang/{rel}"


def _load(mod_name: str, package: str, source: str, filename: str, builtins=None):
    module = types.ModuleType(mod_name)
    module.__file__ = filename
    if builtins is not None:
        module.__builtins__ = builtins
    # Its source for inspect (Triton's @jit reads the kernels it defines): the path
    # lies inside the wheel, so linecache holds it (mtime None: checkcache keeps it).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module.__package__ = package
    sys.modules[mod_name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def pin_aux_module():
    """The pristine release's ``sglang/srt/layers/aux_hidden_states.py`` as a module of
    its own (its list, its packer, its ``pack_aux_hidden_states``), or None where the
    release predates that file."""
    if PIN_AUX in sys.modules:
        return sys.modules[PIN_AUX]
    found = _pristine_source("srt/layers/aux_hidden_states.py")
    return None if found is None else _load(PIN_AUX, "sglang.srt.layers", *found)


# What the 0.5.23 series removes or narrows in aux_hidden_states.py (the list path).
# Pristine code keeps the release's own of these; the rest it takes from the patched
# tree, as it takes every other module.
LIST_PATH = ("AuxHiddenStateList", "AuxHiddenStates", "AuxHiddenStateAccumulator",
             "pack_aux_hidden_states")


def _aux_for_pristine():
    """The ``aux_hidden_states`` a pristine module imports from: the patched module
    with the release's own list path (``LIST_PATH``), or the patched module itself
    where the release predates that file."""
    import importlib

    patched = importlib.import_module(AUX)
    pristine = pin_aux_module()
    if pristine is None:
        return patched
    view = types.ModuleType(PIN_AUX + "_view")
    view.__dict__.update({k: v for k, v in vars(patched).items() if not k.startswith("__")})
    view.__dict__.update({k: getattr(pristine, k) for k in LIST_PATH if hasattr(pristine, k)})
    return view


def pristine_module(rel: str, mod_name: str | None = None):
    """The pristine release's ``sglang/<rel>`` (e.g. ``srt/models/llama.py``) as a
    module of its own. It imports the rest of SGLang from the patched tree, except
    the list path of the aux hidden states (``LIST_PATH``), which is the release's
    own: a series may remove what pristine code collects into and how the logits
    processor concatenates it (0.5.23's ``AuxHiddenStateList``). Only the module's
    own imports see that; what it imports in turn is the patched tree's."""
    import builtins

    mod_name = mod_name or "sglang._auxcap_pin." + rel.removesuffix(".py").replace("/", ".")
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    found = _pristine_source(rel)
    if found is None:
        raise FileNotFoundError(f"sglang/{rel}: not in the pristine release")
    aux = _aux_for_pristine()
    real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == AUX and fromlist and level == 0:
            return aux
        return real_import(name, globals, locals, fromlist, level)

    own_builtins = {**vars(builtins), "__import__": _import}
    try:
        return _load(mod_name, "sglang." + rel.rsplit("/", 1)[0].replace("/", "."), *found,
                     builtins=own_builtins)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise


def pin_module(name: str):
    """The pristine pin's ``sglang/srt/models/<name>.py`` as a module of its own
    (``pristine_module``)."""
    return pristine_module(f"srt/models/{name}.py", PIN_MODULE.format(name=name))


def pack_for_draft(aux):
    """What the logits processor hands the draft for a forward's captures: the packed
    tensor as it is, a list concatenated (``torch.cat``) by the pristine release's
    ``pack_aux_hidden_states``, as that release's logits processor does. A list comes
    from pristine code; a series may have removed the list path (0.5.23)."""
    import torch

    if not isinstance(aux, torch.Tensor):
        pristine = pin_aux_module()
        if pristine is not None:
            return pristine.pack_aux_hidden_states(aux)
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    return pack_aux_hidden_states(aux)


def _peak(model, spec, tokens: int, layers: Sequence[int], device: str) -> tuple[int, int]:
    """(peak bytes over baseline of forward + pack, bytes the capture path holds at its
    peak: the captures the forward returns plus what packing them adds)."""
    import torch

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
        return hidden, None if aux is None else pack_for_draft(aux)

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
    from harness.memory.tracker import make_tracker

    with make_tracker(device) as tracker:
        packed = pack_for_draft(aux)
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


__all__ = ["pin_module", "pristine_module", "pin_aux_module", "pack_for_draft", "model_capture_peaks", "held_bytes", "capture_path_bytes"]
