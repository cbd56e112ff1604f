"""The planted conventions of ``doctor-demo`` and the doctor's tests: tiny targets and
drafts, and features made by a trainer-shaped path (:mod:`harness.doctor.planting`).

Each :class:`Case` plants one convention (``planted``, in the keys of
:func:`harness.doctor.verdict.conventions`) and says what this base's server must make
of it (``expected``: "match" or "mismatch"; a mismatch must come with a fix, verified by
serving it, unless ``fixable`` is False). The doctor passes a case when every planted
key is detected with the planted value, its verdict is the expected one and every
mismatched slot names its fix. Stdlib-only at import time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.doctor.declared import read_config
from harness.e2e.multimodal import VL_TOKENS, VL_VISION

PIN, NEWEST = "0.5.13.post1", "0.5.23"
LAYERS = 6
SEQUENCE_TOKENS = 24
IMAGE_GRID = (1, 4, 4)   # t, h, w patches: 16 patches, 4 image tokens after the 2x2 merge


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    method: str                          # "EAGLE3" | "DFLASH"
    ids: tuple[int, ...]
    planted: dict = field(default_factory=dict)
    expected: Any = "match"              # a verdict, or {base: verdict}
    fixable: bool = True
    source: str = "transformers"         # "transformers" | "engine" (0.5.23's return-aux)
    meaning: str = "sglang"              # transformers path: id -> hidden_states[id + 1] or [id]
    last: str = "hidden_states"          # transformers path: "hidden_states" (post_norm) | "pre_norm"
    deepstack: str = "transformers5"     # transformers path: "transformers5" | "4.57"
    residual: bool = True
    engine_final_layer_capture: Optional[str] = None
    norm_tensor_without_key: bool = False
    fmt: str = "torch"

    def expected_on(self, base: str) -> str:
        return self.expected[base] if isinstance(self.expected, dict) else self.expected

    def bases(self) -> tuple[str, ...]:
        return (NEWEST,) if self.source == "engine" else (PIN, NEWEST)


CASES: tuple[Case, ...] = (
    Case("llama-ids-sglang", "llama", "EAGLE3", (1, 3, 4), {"ids": "sglang"}),
    Case("llama-ids-vllm", "llama", "EAGLE3", (1, 3, 4), {"ids": "vllm"}, "mismatch", meaning="vllm"),
    Case("qwen3-ids-sglang", "qwen3", "EAGLE3", (0, 2, 4), {"ids": "sglang"}, fmt="safetensors"),
    Case("qwen3-ids-vllm", "qwen3", "EAGLE3", (1, 2, 4), {"ids": "vllm"}, "mismatch", meaning="vllm",
         fmt="safetensors"),
    Case("llama-last-pre-norm", "llama", "DFLASH", (1, 3, 5), {"final_layer": "pre_norm", "ids": "layer_output"},
         last="pre_norm"),
    Case("llama-last-post-norm", "llama", "DFLASH", (1, 3, 5), {"final_layer": "post_norm"}, "mismatch"),
    Case("qwen3_vl-pre-deepstack", "qwen3_vl", "EAGLE3", (0, 2, 4), {"deepstack": "pre_deepstack"},
         {PIN: "match", NEWEST: "mismatch"}),
    Case("qwen3_vl-post-deepstack", "qwen3_vl", "EAGLE3", (0, 2, 4), {"deepstack": "post_deepstack"},
         {PIN: "mismatch", NEWEST: "match"}, deepstack="4.57"),
    Case("gemma3-with-residual", "gemma3", "EAGLE3", (1, 3, 4), {"residual": "with"}),
    Case("gemma3-without-residual", "gemma3", "EAGLE3", (1, 3, 4), {"residual": "without"}, "mismatch",
         fixable=False, residual=False),
    # deepseek_v2's setter adds 1 only when the first id is 1 (sgl-project/sglang#25454):
    # features in SGLang's meaning for ids [0, 2, 4] are served one layer early, and no ids
    # serve them.
    Case("deepseek_v3-ids-first-not-1", "deepseek_v3", "EAGLE3", (0, 2, 4), {"ids": "sglang"}, "mismatch",
         fixable=False),
    Case("llama-norm-before-fc-no-key", "llama", "EAGLE3", (1, 3, 4),
         {"norm_before_fc": "tensors_without_key"}, "mismatch", norm_tensor_without_key=True),
    # The features SGLang's own Engine returns (0.5.23's --enable-return-aux-hidden-states).
    Case("llama-ids-sglang-engine", "llama", "EAGLE3", (1, 3, 4), {"ids": "sglang"}, source="engine"),
    Case("llama-last-pre-norm-engine", "llama", "DFLASH", (1, 3, 5), {"final_layer": "pre_norm"},
         source="engine"),
    Case("llama-last-post-norm-engine", "llama", "DFLASH", (1, 3, 5), {"final_layer": "post_norm"}, "mismatch",
         source="engine", engine_final_layer_capture="post_norm"),
)


def cases(base: str, sources: tuple[str, ...] = ("transformers", "engine")) -> list[Case]:
    return [c for c in CASES if base in c.bases() and c.source in sources]


# ----------------------------------------------------------------------------- checkpoints


def family_for(name: str):
    """The parity family ``name`` with the demo's depth (and, for Qwen3-VL, a tower that
    feeds deepstack into three layers, and special tokens inside its vocabulary)."""
    from harness.parity.families import families

    fam = families()[name]
    base_config = fam.config

    def config():
        cfg = base_config()
        text = cfg.get("text_config", cfg)
        tiny = int(text["num_hidden_layers"])
        text["num_hidden_layers"] = LAYERS
        for key, value in list(text.items()):  # per-layer lists (layer_types): the pattern repeated
            if isinstance(value, list) and len(value) == tiny and key.endswith("_types"):
                text[key] = [value[i % len(value)] for i in range(LAYERS)]
        if name.startswith("qwen3_vl"):
            cfg["vision_config"] = {**cfg["vision_config"], **VL_VISION}
            cfg.update(VL_TOKENS)
        return cfg

    return dataclasses.replace(fam, config=config)


def make_target(name: str, directory: Path):
    """The family's tiny target (perturbed, float32) in ``directory``, once; returns
    transformers' model of it."""
    from harness.parity import reference

    return reference.make_checkpoint(family_for(name), directory)


def sequence(case: Case, vocab: int, seed: int = 21) -> tuple[list[int], dict[str, Any]]:
    """The features' token sequence, and for Qwen3-VL the image inputs
    (``pixel_values``, ``image_grid_thw``) of its image tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(3, min(vocab, VL_TOKENS["image_token_id"]), (SEQUENCE_TOKENS,), generator=gen).tolist()
    if not case.family.startswith("qwen3_vl"):
        return text, {}
    t, h, w = IMAGE_GRID
    merged = t * h * w // 4
    ids = (text[:6] + [VL_TOKENS["vision_start_token_id"]] + [VL_TOKENS["image_token_id"]] * merged
           + [VL_TOKENS["vision_end_token_id"]] + text[6:14])
    patch = 3 * 2 * 4 * 4   # channels x temporal patch x patch x patch (the tiny tower's)
    pixels = torch.randn(t * h * w, patch, generator=gen)
    types = (torch.tensor(ids) == VL_TOKENS["image_token_id"]).int()   # 0 text, 1 image
    return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([list(IMAGE_GRID)]),
                 "mm_token_type_ids": types}


def make_draft(case: Case, directory: Path, hidden: int, layers: int) -> Path:
    """The case's draft: SGLang's EAGLE3 (``LlamaForCausalLMEagle3``) or DFlash draft of
    the e2e tier, its fc reading K captures of ``hidden``; with
    ``norm_tensor_without_key`` an ``input_norm.weight`` beside fc and no key."""
    from harness.e2e import checkpoints

    if hidden != checkpoints.H:
        raise ValueError(f"the demo's drafts read targets of hidden size {checkpoints.H}, not {hidden}")
    if case.method == "EAGLE3":
        checkpoints.make_eagle3(directory, list(case.ids), exact=False)
    else:
        checkpoints.make_dflash(directory, list(case.ids), layers, exact=False)
    if case.norm_tensor_without_key:
        import torch

        def add(tensors):
            tensors["input_norm.weight"] = 1.0 + 0.1 * torch.randn(len(case.ids) * hidden)
        checkpoints._edit_safetensors(directory, add)
    return directory


def plant(case: Case, target_dir: Path, model, draft_dir: Path, features_path: Path, session=None) -> Path:
    """The case's features file, made by its trainer-shaped path."""
    from harness.doctor import planting

    config = read_config(target_dir, "target")
    fam = family_for(case.family)
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    ids, images = sequence(case, vocab)
    aux, hidden_state = planting.transformers_features(
        model, fam.hf_final_norm, ids, case.ids, meaning=case.meaning, last=case.last,
        deepstack=case.deepstack, residual=case.residual, extra=images)
    if case.source == "engine":
        if session is None:
            raise ValueError(f"{case.name}: engine features need an Engine session")
        aux = planting.engine_features(session, target_dir, fam.setup, ids, case.ids, case.method,
                                       case.engine_final_layer_capture)
    return planting.save(features_path, ids, aux, hidden_state, case.fmt, images)


def summary(case: Case, report, base: str) -> dict[str, Any]:
    """The demo's entry for ``case``: ``{"family", "planted", "detected", "verdict", ...}``
    and whether the doctor got it right (``ok``, with ``problems``)."""
    detected = dict(report.conventions)
    problems = [f"planted {k}={v}, detected {detected.get(k)}" for k, v in case.planted.items()
                if detected.get(k) != v]
    want = case.expected_on(base)
    if report.verdict != want:
        problems.append(f"verdict {report.verdict}, expected {want}")
    mismatched = [s for s in report.slots if s.verdict == "mismatch"]
    if want == "mismatch":
        named = [s for s in mismatched if s.fix] + [f for f in report.findings if f.severity == "error" and f.fix]
        if not named:
            problems.append("no fix named for the mismatch")
        if case.fixable and mismatched and not report.change.get("verified"):
            problems.append(f"the proposed change was not verified: {report.change}")
    fixes = sorted({s.fix for s in mismatched if s.fix} | {f.fix for f in report.findings if f.severity == "error"})
    return {"case": case.name, "family": case.family, "source": case.source, "planted": case.planted,
            "detected": detected, "verdict": report.verdict, "expected": want, "fix": fixes,
            "ok": not problems, "problems": problems}


def dump(entries: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")
