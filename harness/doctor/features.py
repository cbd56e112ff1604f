"""What a draft was trained on: a trainer's features file against transformers.

Formats read (one sequence per file; a directory: its feature files in name order):

* SpecForge's offline data: a torch file (``torch.save`` of a dict) with ``input_ids``
  (``[T]`` or ``[1, T]``), ``aux_hidden_state`` (``[T, K * H]`` or ``[1, T, K * H]``) and
  optionally ``hidden_state`` (the last hidden state, ``[T, H]`` or ``[1, T, H]``) and
  ``loss_mask``;
* a safetensors file with the same keys;
* for a Qwen3-VL target, ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``
  (0 text, 1 image; derived from the config's ``image_token_id`` where absent) as its
  processor returns them, so transformers computes the deepstack features of the file's
  image tokens.

transformers runs the target with its real weights (float32 unless told otherwise) over
each file's ``input_ids`` (the first ``max_tokens`` of them: it is causal, so a prefix's
rows are the prefix's), and every slot of ``aux_hidden_state`` is matched against every
term (:mod:`harness.doctor.terms`), with the error of the best and of the runner-up.
Stdlib-only at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness import HarnessError

SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")
KEYS = ("input_ids", "aux_hidden_state", "hidden_state", "loss_mask", "pixel_values", "image_grid_thw",
        "mm_token_type_ids")


@dataclass
class Sequence:
    path: Path
    input_ids: Any          # [T] int64
    aux: Any                # [T, K * H]
    hidden_state: Any = None
    pixel_values: Any = None
    image_grid_thw: Any = None
    mm_token_type_ids: Any = None


def _load_one(path: Path) -> dict[str, Any]:
    import torch

    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(path))
        else:
            data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise HarnessError(f"doctor: features {path}: cannot read it: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"doctor: features {path}: a {type(data).__name__}, not a dict of tensors "
                           "(SpecForge's input_ids / aux_hidden_state / hidden_state)")
    return data


def _rows(t, path: Path, key: str, width: Optional[int] = None):
    """``t`` as ``[T, width]`` (a leading batch dimension of 1 dropped)."""
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or (width is not None and t.shape[1] != width):
        raise HarnessError(f"doctor: features {path}: {key} of shape {tuple(t.shape)}, expected "
                           f"[T, {width or 'H'}] (or [1, T, ...])")
    return t


def load(location: Path, hidden: int, max_files: int = 4, max_tokens: int = 512) -> list[Sequence]:
    """The sequences of the features at ``location`` (a file, or a directory of them),
    checked against the target's hidden size ``hidden``; one error naming the file."""
    import torch

    location = Path(location)
    if location.is_dir():
        files = sorted(p for p in location.iterdir() if p.suffix in SUFFIXES)[:max_files]
        if not files:
            raise HarnessError(f"doctor: features {location}: no {'/'.join(SUFFIXES)} files there")
    elif location.exists():
        files = [location]
    else:
        raise HarnessError(f"doctor: features {location}: no such file or directory")
    out = []
    for path in files:
        data = _load_one(path)
        missing = [k for k in ("input_ids", "aux_hidden_state") if k not in data]
        if missing:
            raise HarnessError(f"doctor: features {path}: no {' or '.join(missing)} (keys: {sorted(data)})")
        ids = data["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            raise HarnessError(f"doctor: features {path}: input_ids is not an integer tensor")
        ids = ids.reshape(-1).long()
        aux = _rows(data["aux_hidden_state"], path, "aux_hidden_state")
        if aux.shape[0] != ids.shape[0]:
            raise HarnessError(f"doctor: features {path}: aux_hidden_state has {aux.shape[0]} rows for "
                               f"{ids.shape[0]} input_ids")
        if aux.shape[1] % hidden:
            raise HarnessError(f"doctor: features {path}: aux_hidden_state is {aux.shape[1]} wide, not a "
                               f"multiple of the target's hidden size {hidden}")
        hs = data.get("hidden_state")
        if hs is not None:
            hs = _rows(hs, path, "hidden_state", hidden)
        pixels = data.get("pixel_values")
        n = ids.shape[0] if pixels is not None else min(ids.shape[0], max_tokens)
        types = data.get("mm_token_type_ids")
        out.append(Sequence(path, ids[:n], aux[:n], None if hs is None else hs[:n], pixels,
                            data.get("image_grid_thw"), None if types is None else types.reshape(-1)))
    widths = {s.aux.shape[1] for s in out}
    if len(widths) > 1:
        raise HarnessError(f"doctor: features {location}: files of different widths {sorted(widths)}")
    return out


@dataclass
class Trained:
    """What the features hold, per slot: its best transformers term (a terms.Match)."""

    files: list[str]
    rows: int
    dtype: str
    slots: list[Any] = field(default_factory=list)
    hidden_state: Any = None        # terms.Match of the file's hidden_state, where it has one
    image_rows: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "rows": self.rows, "dtype": self.dtype, "image_rows": self.image_rows,
                "slots": [m.to_json() for m in self.slots],
                "hidden_state": self.hidden_state.to_json() if self.hidden_state else None}


def reference_model(target, dtype: str = "float32"):
    """transformers' model of the target, its real weights, eager attention."""
    import torch
    import transformers

    from harness.parity.reference import _no_hub_kernels

    _no_hub_kernels()
    cls = getattr(transformers, target.family.hf_model_class)
    try:
        model = cls.from_pretrained(str(target.path), dtype=getattr(torch, dtype),
                                    attn_implementation="eager")
    except Exception as exc:
        raise HarnessError(f"doctor: target {target.path}: transformers cannot load it as "
                           f"{target.family.hf_model_class}: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]}") from None
    return model.eval()


def _call(model, seq: Sequence):
    import functools

    kwargs: dict[str, Any] = dict(output_hidden_states=True, use_cache=False)
    if seq.pixel_values is not None:
        types = seq.mm_token_type_ids
        if types is None:   # what the processor returns: 1 on image tokens, 0 on text
            types = (seq.input_ids == getattr(model.config, "image_token_id", -1)).int()
        kwargs.update(pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw,
                      mm_token_type_ids=types.reshape(1, -1))
    return functools.partial(model, input_ids=seq.input_ids.unsqueeze(0), **kwargs)


def match(target, sequences: list[Sequence], dtype: str = "float32") -> Trained:
    """Every slot of the features against transformers' terms on the target's weights."""
    import torch

    from harness.doctor import terms as T

    model = reference_model(target, dtype)
    found = T.collect(model, target.family.hf_final_norm, [_call(model, s) for s in sequences])
    aux = torch.cat([s.aux for s in sequences]).float()
    image_token = getattr(model.config, "image_token_id", None)
    image_rows = sum(int((s.input_ids == image_token).sum()) for s in sequences
                     if s.pixel_values is not None and image_token is not None)
    trained = Trained([str(s.path) for s in sequences], int(aux.shape[0]),
                      str(sequences[0].aux.dtype).replace("torch.", ""), image_rows=image_rows)
    trained.slots = [T.match(slot, found) for slot in T.split_slots(aux, target.hidden)]
    if all(s.hidden_state is not None for s in sequences):
        trained.hidden_state = T.match(torch.cat([s.hidden_state for s in sequences]).float(), found)
    return trained
