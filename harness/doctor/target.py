"""The target: its family among the parity tier's, its depth, and a shrunk copy of its
config (stdlib only at import time).

The served mapping (:mod:`harness.doctor.served`) runs SGLang's real model and
transformers' real class on a *shrunk* copy of the target's config: the family's tiny
widths (the parity tier's, ``harness.parity.families``: hidden 64, a few heads and
experts, float32) with the target's depth kept, everything a capture id can name or a
layer's kind depends on: ``num_hidden_layers``, the per-layer lists (``layer_types``),
the dense/sparse layer pattern (``first_k_dense_replace``, ``decoder_sparse_step``, ...)
and, for Qwen3-VL, the vision tower's ``deepstack_visual_indexes``. A 61-layer target is
61 tiny layers: what each capture id maps to is the same as on the real weights.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from harness import HarnessError
from harness.doctor.declared import read_config

# Scalars that say which layers are which kind: kept from the target.
DEPTH_SCALARS = ("num_hidden_layers", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
                 "full_attention_interval", "sliding_window_pattern", "interleave_moe_layer_step",
                 "num_loops")
# dtype names as configs write them.
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")


@dataclass
class Target:
    path: Path
    config: dict[str, Any]
    family: Any                 # harness.parity.families.Family
    layers: int                 # decoder layers (the text config's num_hidden_layers)
    hidden: int
    dtype: Optional[str]        # what the config says; the served dtype is SGLang's resolution
    deepstack_layers: tuple[int, ...]  # Qwen3-VL: the decoder layers whose output takes deepstack

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config.get("text_config") or self.config

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "family": self.family.name,
                "architectures": self.config.get("architectures"), "layers": self.layers,
                "hidden": self.hidden, "config_dtype": self.dtype,
                "deepstack_layers": list(self.deepstack_layers)}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def find_family(config: dict[str, Any], base_label: str, path: Path):
    """The parity family of ``config`` on the active base, or one error."""
    from harness.parity.families import families

    arches = list(config.get("architectures") or [])
    model_type = config.get("model_type")
    known = families()
    matches = [f for f in known.values() if f.hf_model_class in arches]
    if not matches:
        served = sorted({f.hf_model_class for f in known.values() if base_label in f.bases})
        raise HarnessError(
            f"doctor: target {path}: unknown family: architectures {arches} (model_type {model_type!r}) "
            f"is none the parity tier serves ({', '.join(served)})")
    on_base = [f for f in matches if base_label in f.bases]
    if not on_base:
        raise HarnessError(
            f"doctor: target {path}: {matches[0].name} is not served on SGLang {base_label} "
            f"(its parity family runs on {', '.join(matches[0].bases)}): pass BASE=<one of those>")
    plain = [f for f in on_base if not f.name.endswith("_window")] or on_base
    if len(plain) == 1:
        return plain[0]
    named = [f for f in plain if f.name == model_type]
    if named:
        return named[0]
    # Same class, other configs (gemma4 / gemma4_moe): the one whose tiny text config
    # shares the most set keys with the target's.
    text = _text(config)

    def overlap(fam) -> int:
        tiny = _text(fam.config())
        return sum(1 for k, v in tiny.items() if v not in (None, False, 0, [], {}) and text.get(k))
    return max(plain, key=lambda f: (overlap(f), -len(f.name)))


def read(directory: Path, base_label: str) -> Target:
    directory = Path(directory)
    config = read_config(directory, "target")
    family = find_family(config, base_label, directory)
    text = _text(config)
    try:
        # NemotronH counts its layers by their block types.
        layers = int(text.get("num_hidden_layers") or len(text["layers_block_type"]))
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise HarnessError(f"doctor: target {directory}/config.json: no num_hidden_layers / hidden_size "
                           "(in text_config for a multimodal model)") from None
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    # The language model adds deepstack feature d to decoder layer d's output, for the
    # first len(deepstack_visual_indexes) layers (the indexes name vision blocks).
    deepstack = tuple(range(len(vision.get("deepstack_visual_indexes") or ())))
    return Target(directory, config, family, layers, hidden, str(dtype) if dtype else None, deepstack)


def shrunk_config(target: Target) -> dict[str, Any]:
    """The family's tiny config (keyword arguments of its transformers config class) with
    the target's depth: see the module docstring."""
    tiny = copy.deepcopy(target.family.config())
    t_tiny, t_src = _text(tiny), target.text_config
    tiny_layers = int(t_tiny.get("num_hidden_layers") or len(t_tiny["layers_block_type"]))
    if "num_hidden_layers" in t_tiny or "num_hidden_layers" in t_src:
        t_tiny["num_hidden_layers"] = target.layers
    for key in DEPTH_SCALARS:
        if key in t_src:
            t_tiny[key] = copy.deepcopy(t_src[key])
    for key, value in list(t_tiny.items()):
        if not isinstance(value, list) or len(value) != tiny_layers or key in DEPTH_SCALARS:
            continue
        src = t_src.get(key)
        if isinstance(src, list) and len(src) == target.layers:
            t_tiny[key] = copy.deepcopy(src)
        else:  # the tiny pattern, repeated over the target's depth
            t_tiny[key] = [value[i % len(value)] for i in range(target.layers)]
    if "mlp_only_layers" in t_src and "mlp_only_layers" in t_tiny:
        t_tiny["mlp_only_layers"] = [i for i in t_src["mlp_only_layers"] if i < target.layers]
    if target.deepstack_layers and isinstance(tiny.get("vision_config"), dict):
        # The served mapping hands the language model deepstack features itself; the
        # tiny tower only needs a block for each index.
        vision = tiny["vision_config"]
        vision["deepstack_visual_indexes"] = list(target.deepstack_layers)
        vision["depth"] = max(int(vision.get("depth", 1)), len(target.deepstack_layers))
    return tiny


def shrunk_family(target: Target):
    """The target's family whose ``config()`` is :func:`shrunk_config`."""
    config = shrunk_config(target)
    return dataclasses.replace(target.family, config=lambda: copy.deepcopy(config))
