"""What reaches the draft, recorded inside the Engine's scheduler process.

``install(path)`` (called in the scheduler process when ``HARNESS_E2E_PROBE`` names a
file) appends one JSON line per event to ``path``:

- ``{"event": "set_layers", "setter": ..., "model": ..., "layer_ids": [...],
  "layers_to_capture": [...]}``: each call of the real
  ``set_eagle3_layers_to_capture`` / ``set_dflash_layers_to_capture`` (``model_runner``
  calls them) on a model class of the target, and what it left in
  ``model.layers_to_capture``;
- ``{"event": "deepstack", "model": ..., "value": ...}``: each call of a model's
  ``set_deepstack_capture`` (Qwen3-VL's language models; the model runner hands it the
  draft config's or the server's ``deepstack_capture``);
- ``{"event": "aux", "k": K, "hidden": H, "tokens": T, "last_is_final": bool}``: every
  ``LogitsProcessor`` call that received aux hidden states (list or packed): how many
  captures, of what width, and whether the last one equals the final hidden states it
  was handed (the final norm's output: a ``post_norm`` capture of the last layer);
- ``{"event": "fc", "model": ..., "in": W, "expected": E}``: every input to the draft's
  ``fc`` (EAGLE3 ``LlamaForCausalLMEagle3``, ``DFlashDraftModel``), its width against
  the width the layer takes;
- ``{"event": "captures", "mode": ..., "input_ids": [...], "positions": [...],
  "segments": [[req_pool_index, length], ...], "ancestors": [...] | null, "rows":
  [[...K*H floats...], ...]}``: every target forward's captures, whole (packed, or the
  list concatenated in order), with the tokens and positions of that forward and each
  request's rows (in order) by its ``req_pool_indices`` slot; for a target-verify
  forward, ``ancestors[r]`` lists the draft rows row ``r`` attends to in its request's
  segment (itself included), read from the verify tree mask (``spec_info.custom_mask``,
  the FULL_MASK layout: per request ``n x (prefix + n)``), so a test can rebuild the
  token sequence each row was computed on.

The wrappers only record, then call SGLang's own code with the same arguments.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

ENV = "HARNESS_E2E_PROBE"
_LOCK = threading.Lock()
_PATH: list[str] = []
SETTER_MODULES = (
    "sglang.srt.models.llama",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.models.gpt_oss",
    "sglang.srt.models.qwen3_vl",
    "sglang.srt.models.qwen3_vl_moe",
)
DRAFTS = {
    "sglang.srt.models.llama_eagle3": "LlamaModel",
    "sglang.srt.models.dflash": "DFlashDraftModel",
}


def _write(record: dict[str, Any]) -> None:
    with _LOCK:
        with open(_PATH[0], "a") as f:
            f.write(json.dumps(record) + "\n")


def _wrap_setters(module) -> None:
    for cls in list(vars(module).values()):
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for setter in ("set_eagle3_layers_to_capture", "set_dflash_layers_to_capture"):
            original = cls.__dict__.get(setter)
            if original is None or getattr(original, "__harness_probe__", False):
                continue

            def wrapper(self, *args, __original=original, __setter=setter, **kwargs):
                result = __original(self, *args, **kwargs)
                processor = getattr(self, "logits_processor", None)
                if processor is not None:
                    processor.__harness_target__ = True
                inner = getattr(self, "model", self)
                ids = args[0] if args else kwargs.get("layer_ids")
                _write({"event": "set_layers", "setter": __setter, "model": type(self).__name__,
                        "layer_ids": None if ids is None else list(ids),
                        "layers_to_capture": list(getattr(inner, "layers_to_capture", []) or [])})
                return result

            wrapper.__harness_probe__ = True
            setattr(cls, setter, wrapper)
        original = cls.__dict__.get("set_deepstack_capture")
        if original is not None and not getattr(original, "__harness_probe__", False):
            def deepstack(self, value, __original=original):
                _write({"event": "deepstack", "model": type(self).__name__, "value": value})
                return __original(self, value)

            deepstack.__harness_probe__ = True
            cls.set_deepstack_capture = deepstack


def _wrap_logits_processor(module) -> None:
    cls = module.LogitsProcessor
    original = cls.forward

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                *args, **kwargs):
        if aux_hidden_states is not None:
            hidden = int(hidden_states.shape[-1])
            if isinstance(aux_hidden_states, (list, tuple)):
                k = len(aux_hidden_states)
                tokens = int(aux_hidden_states[0].shape[0]) if k else 0
                last = aux_hidden_states[-1] if k else None
            else:
                k = int(aux_hidden_states.shape[-1]) // hidden if hidden else 0
                tokens = int(aux_hidden_states.shape[0])
                last = aux_hidden_states[..., -hidden:] if k else None
            last_is_final = (last is not None and tuple(last.shape) == tuple(hidden_states.shape)
                             and bool((last == hidden_states).all()))
            target = bool(getattr(self, "__harness_target__", False))
            _write({"event": "aux", "target": target,
                    "k": k, "hidden": hidden, "tokens": tokens, "last_is_final": last_is_final})
            if target and tokens:
                _write(_captures(aux_hidden_states, input_ids, logits_metadata))
        return original(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states,
                        *args, **kwargs)

    cls.forward = forward


def _captures(aux, input_ids, batch) -> dict[str, Any]:
    """The ``captures`` record of one target forward (module docstring)."""
    import torch

    packed = torch.cat(list(aux), dim=-1) if isinstance(aux, (list, tuple)) else aux
    mode = batch.forward_mode
    pools = [int(i) for i in batch.req_pool_indices.tolist()]
    positions = [int(p) for p in batch.positions.tolist()]
    record: dict[str, Any] = {"event": "captures", "mode": mode.name,
                              "input_ids": [int(t) for t in input_ids.tolist()], "positions": positions,
                              "ancestors": None}
    if mode.is_target_verify():
        spec = batch.spec_info
        n = int(getattr(spec, "draft_token_num", 0) or len(positions) // max(len(pools), 1))
        lengths = [n] * len(pools)
        mask = getattr(spec, "custom_mask", None)
        record["ancestors"] = _tree_ancestors(mask, positions, n, len(pools))
        record["mask_size"] = None if mask is None else int(mask.numel())
    elif mode.is_extend():
        lengths = [int(x) for x in (batch.extend_seq_lens_cpu or batch.extend_seq_lens.tolist())]
    else:  # decode: one token a request
        lengths = [1] * len(pools)
    record["segments"] = [list(x) for x in zip(pools, lengths)]
    record["rows"] = packed.float().tolist()
    return record


def _tree_ancestors(mask, positions: list[int], n: int, bs: int) -> list[list[int]] | None:
    """Per verify row, the rows of its request's segment it attends to (itself included),
    from the FULL_MASK tree mask: request ``i``'s block is ``n x (prefix_i + n)``, row
    major, its prefix ``prefix_i`` the segment's first position (the buffer may be
    longer). None without a mask, or when it does not read as that layout: every row
    attends to itself and to row 0, whose only draft row is itself."""
    if mask is None:
        return None
    flat = mask.reshape(-1).tolist()
    out: list[list[int]] = []
    offset = 0
    for i in range(bs):
        prefix = positions[i * n]
        width = prefix + n
        if offset + n * width > len(flat):
            return None
        for r in range(n):
            row = flat[offset + r * width: offset + (r + 1) * width]
            path = [c for c in range(n) if row[prefix + c]]
            if r not in path or 0 not in path or (r == 0 and path != [0]):
                return None
            out.append(path)
        offset += n * width
    return out


def _wrap_draft(module, class_name: str) -> None:
    cls = getattr(module, class_name)
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        fc = getattr(self, "fc", None)
        if fc is None:
            return
        expected = int(getattr(fc, "in_features", getattr(fc, "input_size", 0)))
        model = f"{module.__name__.rsplit('.', 1)[-1]}.{class_name}"

        def record(_module, inputs):
            _write({"event": "fc", "model": model, "in": int(inputs[0].shape[-1]), "expected": expected})

        fc.register_forward_pre_hook(record)

    cls.__init__ = __init__


def install(path: str) -> None:
    """Record to ``path`` from now on, in this process (idempotent)."""
    from harness.standins.cpu_engine.hooks import when_imported

    if _PATH:
        return
    _PATH.append(path)
    for name in SETTER_MODULES:
        when_imported(name, _wrap_setters)
    when_imported("sglang.srt.layers.logits_processor", _wrap_logits_processor)
    for name, cls in DRAFTS.items():
        when_imported(name, lambda module, cls=cls: _wrap_draft(module, cls))


def install_from_env() -> None:
    path = os.environ.get(ENV)
    if path:
        install(path)


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
