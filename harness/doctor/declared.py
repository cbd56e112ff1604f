"""What a draft checkpoint declares about the features it reads (stdlib only).

Every key that servers and trainers use to say which target layers a draft reads and
how, wherever it sits:

* ``eagle_config`` (SGLang's and vLLM's EAGLE3 drafts): ``eagle_aux_hidden_state_layer_ids``,
  ``use_aux_hidden_state``, and this series' ``final_layer_capture`` / ``deepstack_capture``;
* speculators' top-level keys (vLLM's speculators format, NVIDIA's and Red Hat's drafts):
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
  ``target_hidden_size``;
* ``dflash_config.target_layer_ids`` (DFlash), ``dspark_target_layer_ids`` /
  ``dspark_config`` (DSpark), and top-level ``target_layer_ids``, which SGLang's DFlash
  parser reads when ``dflash_config`` lacks it.

The weights are read from the safetensors headers alone (names, shapes, dtypes; no
tensor data): ``fc.weight``'s input width against the id count times
``target_hidden_size``, and the norm keys against the norm tensors (``input_norm`` for
``norm_before_fc``, ``fc_norm.<i>`` / the legacy ``aux_norm_*`` for ``fc_norm``). SGLang's
draft loaders skip a tensor they have no parameter for without a word
(``llama_eagle3.py`` ``load_weights``), so a norm tensor that no key turns on is simply
not applied.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness import HarnessError

# Where the capture ids may sit: (section or None for the top level, key, method).
ID_KEYS: tuple[tuple[Optional[str], str, str], ...] = (
    ("eagle_config", "eagle_aux_hidden_state_layer_ids", "EAGLE3"),
    (None, "eagle_aux_hidden_state_layer_ids", "EAGLE3"),
    ("dflash_config", "target_layer_ids", "DFLASH"),
    (None, "target_layer_ids", "DFLASH"),
    ("dspark_config", "target_layer_ids", "DSPARK"),
    (None, "dspark_target_layer_ids", "DSPARK"),
)
# Which section holds a method's settings (final_layer_capture, deepstack_capture).
SETTINGS_SECTION = {"EAGLE3": "eagle_config", "DFLASH": "dflash_config", "DSPARK": "dflash_config"}
SETTINGS = ("final_layer_capture", "deepstack_capture")
# EAGLE3's default when the draft names no ids (SGLang's setters, vLLM's
# get_eagle3_aux_hidden_state_layers): three captures.
EAGLE3_DEFAULT_K = 3


@dataclass(frozen=True)
class Finding:
    """Something the doctor noticed: ``severity`` is "error" (the server cannot feed the
    draft what it was built for), "warning" (it may not) or "info"."""

    severity: str
    what: str
    fix: str = ""

    def to_json(self) -> dict[str, str]:
        return {"severity": self.severity, "what": self.what, "fix": self.fix}


@dataclass
class Declaration:
    path: Path
    config: dict[str, Any]
    architectures: list[str]
    method: str                               # "EAGLE3" | "DFLASH" | "DSPARK"
    ids: Optional[list[int]]                  # the ids SGLang's reading would find, or None
    ids_key: Optional[str]                    # where those came from ("eagle_config.eagle_aux_...")
    all_ids: dict[str, list[int]]             # every id key present -> its value
    use_aux_hidden_state: bool
    settings: dict[str, str]                  # final_layer_capture / deepstack_capture, where set
    norms: dict[str, bool]                    # norm_before_fc / fc_norm / norm_output, where set
    target_hidden_size: Optional[int]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape), "model." stripped
    findings: list[Finding] = field(default_factory=list)

    @property
    def fc_in_features(self) -> Optional[int]:
        fc = self.tensors.get("fc.weight")
        return int(fc[1][1]) if fc and len(fc[1]) == 2 else None

    def settings_key(self, setting: str) -> str:
        """Where the draft config holds ``setting`` for its method."""
        return f"{SETTINGS_SECTION[self.method]}.{setting}"

    def ids_key_for_fix(self) -> str:
        """The key a fix of the ids writes: the one SGLang reads for the method."""
        return {"EAGLE3": "eagle_config.eagle_aux_hidden_state_layer_ids",
                "DFLASH": "dflash_config.target_layer_ids",
                "DSPARK": "dspark_target_layer_ids"}[self.method]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "architectures": self.architectures, "method": self.method,
            "ids": self.ids, "ids_key": self.ids_key, "all_ids": self.all_ids,
            "use_aux_hidden_state": self.use_aux_hidden_state, "settings": self.settings,
            "norms": self.norms, "target_hidden_size": self.target_hidden_size,
            "fc_in_features": self.fc_in_features,
            "findings": [f.to_json() for f in self.findings],
        }


def read_config(directory: Path, what: str) -> dict[str, Any]:
    """``directory/config.json`` as a dict, or one error naming the file."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HarnessError(f"doctor: {what} {directory}: no config.json there") from None
    except (OSError, ValueError) as exc:
        raise HarnessError(f"doctor: {what} {path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"doctor: {what} {path}: not a JSON object")
    return data


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (names -> dtype, shape, offsets), read without torch."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HarnessError(f"doctor: {path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise HarnessError(f"doctor: {path}: not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise HarnessError(f"doctor: {path}: unreadable safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return header


def read_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in ``directory`` (its safetensors files, sharded or
    not): name (a leading ``model.`` stripped, as SGLang's draft loaders map it) ->
    (dtype, shape)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise HarnessError(f"doctor: {index}: cannot read it: {exc}") from None
        paths = [directory / name for name in files]
    else:
        paths = sorted(directory.glob("*.safetensors"))
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in paths:
        for name, meta in safetensors_header(path).items():
            key = name[len("model."):] if name.startswith("model.") else name
            out[key] = (str(meta.get("dtype")), tuple(int(d) for d in meta.get("shape", ())))
    return out


def _ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise HarnessError(f"doctor: draft config {key}: {value!r} is not a list of layer ids")
    return list(value)


def method_of(config: dict[str, Any], forced: Optional[str] = None) -> str:
    """The draft's algorithm: ``forced`` (``--speculative-algorithm``), else what its
    architecture and keys say."""
    if forced:
        return forced.upper()
    arches = " ".join(config.get("architectures") or [])
    keys = set(config)
    if "DSpark" in arches or "dspark_config" in keys or any(k.startswith("dspark_") for k in keys):
        return "DSPARK"
    if "DFlash" in arches or "dflash_config" in keys:
        return "DFLASH"
    if ("Eagle3" in arches or "eagle_config" in keys or config.get("speculators_model_type") == "eagle3"
            or "eagle_aux_hidden_state_layer_ids" in keys):
        return "EAGLE3"
    raise HarnessError(
        f"doctor: draft config: cannot tell its algorithm (architectures {config.get('architectures')}; "
        f"no eagle_config, dflash_config or dspark key): pass --speculative-algorithm")


def read(directory: Path, forced_method: Optional[str] = None, base: str = "") -> Declaration:
    """What the draft in ``directory`` declares, and what its config and weights disagree on."""
    directory = Path(directory)
    config = read_config(directory, "draft")
    method = method_of(config, forced_method)
    all_ids: dict[str, list[int]] = {}
    for section, key, _ in ID_KEYS:
        holder = config.get(section) if section else config
        if isinstance(holder, dict) and holder.get(key) is not None:
            name = f"{section}.{key}" if section else key
            all_ids[name] = _ids(holder[key], name)
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    settings_holder = config.get(SETTINGS_SECTION[method])
    settings_holder = settings_holder if isinstance(settings_holder, dict) else {}
    settings = {k: str(settings_holder[k]) for k in SETTINGS if settings_holder.get(k) is not None}
    norms = {}
    for key in ("norm_before_fc", "fc_norm", "norm_output", "use_aux_norm"):
        value = eagle_config.get(key, config.get(key)) if key == "norm_before_fc" else config.get(key)
        if value is not None:
            norms[key] = bool(value)
    hidden = config.get("target_hidden_size")
    tensors = read_tensors(directory)
    decl = Declaration(
        path=directory, config=config, architectures=list(config.get("architectures") or []),
        method=method, ids=None, ids_key=None, all_ids=all_ids,
        use_aux_hidden_state=bool(eagle_config.get("use_aux_hidden_state", True)) if method == "EAGLE3" else True,
        settings=settings, norms=norms,
        target_hidden_size=int(hidden) if isinstance(hidden, int) else None, tensors=tensors,
    )
    _served_ids(decl)
    _check_ids(decl)
    _check_norms(decl, base)
    return decl


def _served_ids(decl: Declaration) -> None:
    """The ids SGLang's reading of the draft finds (its model runner reads EAGLE3 ids from
    ``eagle_config`` only; DFlash's parser ``dflash_config.target_layer_ids``, then the top
    level; DSpark's ``dspark_*`` keys over those)."""
    order = {"EAGLE3": ["eagle_config.eagle_aux_hidden_state_layer_ids"],
             "DFLASH": ["dflash_config.target_layer_ids", "target_layer_ids"],
             "DSPARK": ["dspark_target_layer_ids", "dspark_config.target_layer_ids",
                        "dflash_config.target_layer_ids", "target_layer_ids"]}[decl.method]
    for key in order:
        if key in decl.all_ids:
            decl.ids, decl.ids_key = decl.all_ids[key], key
            return


def _check_ids(decl: Declaration) -> None:
    if decl.method == "EAGLE3" and decl.ids is None and "eagle_aux_hidden_state_layer_ids" in decl.all_ids:
        top = decl.all_ids["eagle_aux_hidden_state_layer_ids"]
        decl.findings.append(Finding(
            "error",
            f"the EAGLE3 ids {top} sit at the config's top level (speculators' key), which SGLang does "
            "not read: it serves its default ids [2, L // 2, L - 3] (vllm-project/vllm#50170: accept "
            "length 1.04 instead of 2.77)",
            f"copy them into eagle_config.eagle_aux_hidden_state_layer_ids, in SGLang's meaning "
            f"(SGLang adds 1: id k is layer k's output): see the slots below"))
    values = {tuple(v) for v in decl.all_ids.values()}
    if len(values) > 1:
        decl.findings.append(Finding(
            "warning", "the draft config names different ids in different keys: "
            + ", ".join(f"{k}={v}" for k, v in decl.all_ids.items())
            + f"; SGLang reads {decl.ids_key or 'none of them'}"))
    if decl.method == "EAGLE3" and not decl.use_aux_hidden_state:
        decl.findings.append(Finding(
            "info", "eagle_config.use_aux_hidden_state is false: the target captures nothing, the draft "
            "reads its last hidden state"))
    k = len(decl.ids) if decl.ids is not None else (EAGLE3_DEFAULT_K if decl.method == "EAGLE3" else None)
    fc_in = decl.fc_in_features
    if fc_in is not None and decl.target_hidden_size and k:
        if fc_in != k * decl.target_hidden_size:
            decl.findings.append(Finding(
                "error",
                f"fc.weight reads {fc_in} features, but the config gives {k} ids x target_hidden_size "
                f"{decl.target_hidden_size} = {k * decl.target_hidden_size}"
                + (f" (fc was trained on {fc_in / decl.target_hidden_size:g} captures)"
                   if fc_in % decl.target_hidden_size == 0 else ""),
                "name as many ids as fc reads (or fix target_hidden_size)"))


def check_against_target(decl: Declaration, hidden: int, layers: int) -> None:
    """The checks that need the target: ``fc``'s width when the draft has no
    ``target_hidden_size``, its value against the target's, and the ids' range."""
    if decl.target_hidden_size is not None and decl.target_hidden_size != hidden:
        decl.findings.append(Finding(
            "error", f"target_hidden_size {decl.target_hidden_size}, but the target's hidden size is {hidden}",
            "this draft was built for another target"))
    k = len(decl.ids) if decl.ids is not None else (EAGLE3_DEFAULT_K if decl.method == "EAGLE3" else None)
    fc_in = decl.fc_in_features
    if fc_in is not None and decl.target_hidden_size is None and k and fc_in != k * hidden:
        decl.findings.append(Finding(
            "error", f"fc.weight reads {fc_in} features, but {k} ids x the target's hidden size {hidden} "
            f"= {k * hidden}", "name as many ids as fc reads"))
    for key, ids in decl.all_ids.items():
        bad = [i for i in ids if not 0 <= i < layers]
        if bad:
            decl.findings.append(Finding(
                "error", f"{key} {ids}: {bad} outside the target's layers 0..{layers - 1}",
                "SGLang refuses these ids at start-up (capture-ids-checked)"))


def _version(v: str) -> tuple[int, ...]:
    """``"0.5.13.post1"`` -> ``(0, 5, 13)``; no version (unknown base): the newest."""
    parts = []
    for p in (v or "999").split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def _has(decl: Declaration, *prefixes: str) -> list[str]:
    return sorted(n for n in decl.tensors if n.startswith(prefixes))


# SGLang releases whose EAGLE3 draft (llama_eagle3.py) has norm_before_fc's input_norm.
NORM_BEFORE_FC_FROM = "0.5.23"


def _check_norms(decl: Declaration, base: str) -> None:
    input_norm = _has(decl, "input_norm.")
    fc_norms = _has(decl, "fc_norm.", "aux_norm_low.", "aux_norm_mid.", "aux_norm_high.",
                    "midlayer.aux_norm_")
    declared_nbf = decl.norms.get("norm_before_fc")
    declared_fcn = decl.norms.get("fc_norm") or decl.norms.get("use_aux_norm")
    if input_norm and not declared_nbf:
        decl.findings.append(Finding(
            "error",
            f"the draft holds {', '.join(input_norm)} (a norm over the concatenated captures before fc), "
            "but no key turns it on: SGLang skips the tensor at load and feeds fc unnormed captures "
            "(sgl-project/sglang#32334: gpt-oss-120b's EAGLE3 draft)",
            'set "norm_before_fc": true in the draft\'s config.json (SGLang reads it from eagle_config '
            "or the top level)" if _version(base) >= _version(NORM_BEFORE_FC_FROM) else
            f"serve the draft on SGLang {NORM_BEFORE_FC_FROM} or later with \"norm_before_fc\": true in its "
            f"config.json: SGLang {base}'s LlamaForCausalLMEagle3 has no input_norm at all"))
    if declared_nbf and not input_norm:
        decl.findings.append(Finding(
            "error", "norm_before_fc is true, but the draft holds no input_norm tensor: the norm runs with "
            "its initial weights", "drop the key, or add the trained input_norm.weight"))
    if fc_norms and not declared_fcn:
        decl.findings.append(Finding(
            "error", f"the draft holds {', '.join(fc_norms)} (a norm per capture before fc), but no key "
            "turns them on: SGLang skips them at load",
            'set "fc_norm": true in the draft config (top level)'))
    if declared_fcn and not fc_norms:
        decl.findings.append(Finding(
            "error", "fc_norm is true, but the draft holds no fc_norm.<i> tensors: the norms run with their "
            "initial weights", "drop the key, or add the trained fc_norm.<i>.weight"))
