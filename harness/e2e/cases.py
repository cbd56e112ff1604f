"""The engine configurations of the tier, what each is sent, and the results it keeps.

One ``Run`` per configuration: every prompt alone, then all of them in one batch, through
one Engine, with the probe on. Tests only read runs (``Runs.get``), so however pytest
orders them, each configuration's Engine starts once.

Prompts (token ids): ``ANCHOR`` ends in an anchor token, so the anchored target emits
``Z`` from its first token on and an exact draft is always right (two verify rounds of
4); ``PARTIAL`` ends in the lead token ``W``: the target says ``A_W`` (an anchor), then
``Z``, and the exact draft, wrong after ``W``, has its first round rejected and every
later one accepted (three rounds: accept length 3.0), so the captures of a verify
forward decide acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.e2e import checkpoints, probe, tokenizer
from harness.e2e.engine import EngineConfig, EngineError, Session

ANCHOR = (12, 40, 99, 16)
PARTIAL = (200, 17, 33, checkpoints.W)
PROMPTS = (ANCHOR, PARTIAL)
# New tokens per prompt, each a whole number of verify rounds when the exact draft runs:
# ANCHOR: the prefill's token, then two rounds of 4; PARTIAL: the prefill's A_W, a
# rejected round (its bonus Z), then two rounds of 4.
MAX_NEW_TOKENS = {ANCHOR: 9, PARTIAL: 10}
# The exact EAGLE3 draft's accept length per prompt (1 + accepted drafts per round).
EXACT_ACCEPT = {ANCHOR: 4.0, PARTIAL: 1.0 + (0 + 3 + 3) / 3}
# The partial EAGLE3 draft's (checkpoints: right at a round's first step only): ANCHOR,
# four rounds of 1 accepted + the bonus; PARTIAL, the rejected round, then four of 1.
PARTIAL_ACCEPT = {ANCHOR: 1.0 + 4 / 4, PARTIAL: 1.0 + (0 + 1 + 1 + 1 + 1) / 5}


def sampling(prompt: tuple[int, ...]) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS[prompt], "ignore_eos": True}


def expected_output(prompt: tuple[int, ...]) -> list[int]:
    """What the anchored target generates greedily for ``prompt``."""
    lead = [checkpoints.A_W] if prompt[-1] == checkpoints.W else []
    return lead + [checkpoints.Z] * (MAX_NEW_TOKENS[prompt] - len(lead))

# The capture ids each draft names: every one includes the target's last layer (3 layers).
LLAMA_LAYERS = 3
DEEPSEEK_LAYERS = 3
LLAMA_IDS = (0, 1, 2)      # llama adds 1: captures 1, 2, 3 (3 = the last layer's output)
DEEPSEEK_IDS = (1, 2)      # deepseek_v2 adds 1 when the first id is 1: captures 2, 3

# The patch that makes the last layer's capture happen, per target family (both bases).
GUARDS = {"llama": "models-capture-final-layer", "deepseek_v3": "dsv2-capture-final-layer"}
# The patch that reads the draft config's final_layer_capture (both bases).
FINAL_LAYER_CAPTURE = "final-layer-capture"
# Bases whose SGLang refuses DFLASH on the CPU (platform_refusal): their DFlash tests
# skip, so they guard nothing there (the ablation counts a skip as not failing).
DFLASH_REFUSED = ("0.5.23",)


@dataclass(frozen=True)
class Case:
    """One Engine configuration."""

    key: str
    model: str                    # target family
    algorithm: str | None = None  # None: plain; "EAGLE3"; "DFLASH"
    draft: str | None = None      # "exact" | "random" | "partial" (exact at a round's first step only)
    dtype: str = "float32"
    topk: int = 1
    steps: int = 3
    draft_tokens: int = 4
    reference_for: str | None = None  # run only as this configuration's plain reference
    # The draft config's final_layer_capture (None: the key is absent, "pre_norm").
    final_layer_capture: str | None = None

    @property
    def aux_ids(self) -> tuple[int, ...]:
        return LLAMA_IDS if self.model == "llama" else DEEPSEEK_IDS

    @property
    def plain_key(self) -> str:
        """The plain configuration its outputs must equal (same target, same dtype)."""
        return f"{self.model}-plain" + {"float32": "", "bfloat16": "-bf16"}[self.dtype]

    @property
    def accept_length(self) -> float:
        """What an always-right draft reaches: every draft token of a round, plus the bonus."""
        return float(self.draft_tokens if self.algorithm == "DFLASH" else self.steps + 1)


CASES = {c.key: c for c in (
    Case("llama-plain", "llama"),
    Case("llama-eagle3-exact", "llama", "EAGLE3", "exact", topk=1),
    Case("llama-eagle3-random", "llama", "EAGLE3", "random", topk=2),
    # Every round accepts 1 of its 3 draft tokens: verify forwards with rejected tokens
    # after accepted ones, each capture checked against transformers.
    Case("llama-eagle3-partial", "llama", "EAGLE3", "partial", topk=1),
    # The draft asks for the final norm's output in its last slot. The anchored target's
    # final norm has unit weights, so the exact draft is exact on either side of it.
    Case("llama-eagle3-postnorm", "llama", "EAGLE3", "exact", topk=1,
         final_layer_capture="post_norm"),
    # DFlash hands the draft input embeddings, which SGLang's forward_extend casts to
    # bfloat16 whatever the model dtype: a DFlash engine runs in bfloat16 or not at all.
    Case("llama-plain-bf16", "llama", dtype="bfloat16", reference_for="llama-dflash-exact"),
    Case("llama-dflash-exact", "llama", "DFLASH", "exact", dtype="bfloat16", draft_tokens=4),
    Case("deepseek_v3-plain", "deepseek_v3"),
    Case("deepseek_v3-eagle3-exact", "deepseek_v3", "EAGLE3", "exact", topk=1),
)}
SPEC_CASES = [c for c in CASES.values() if c.algorithm]
EXACT_CASES = [c for c in SPEC_CASES if c.draft in ("exact", "partial")]
PLAIN_CASES = [c for c in CASES.values() if not c.algorithm]


class Checkpoints:
    """The tier's checkpoints under ``root``, each made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, Any] = {}

    def _once(self, name: str, make: Callable[[Path], Any]) -> Any:
        if name not in self._made:
            self._made[name] = make(self.root / name)
        return self._made[name]

    def target(self, model: str) -> checkpoints.Target:
        if model == "llama":
            return self._once("llama", lambda p: checkpoints.make_llama(p, layers=LLAMA_LAYERS))
        if model == "deepseek_v3":
            return self._once("deepseek_v3", lambda p: checkpoints.make_deepseek(p, layers=DEEPSEEK_LAYERS))
        raise ValueError(f"no target {model!r}")

    def draft(self, case: Case) -> Path | None:
        if case.algorithm is None:
            return None
        ids = list(case.aux_ids)
        name = f"{case.model}-{case.algorithm.lower()}-{case.draft}"
        if case.final_layer_capture:
            name += f"-{case.final_layer_capture}"
        if case.algorithm == "EAGLE3":
            return self._once(name, lambda p: checkpoints.make_eagle3(
                p, ids, exact=case.draft in ("exact", "partial"), final_layer_capture=case.final_layer_capture,
                partial=case.draft == "partial"))
        layers = self.target(case.model).layers
        return self._once(name, lambda p: checkpoints.make_dflash(p, ids, layers, exact=case.draft == "exact",
                                                                  block_size=case.draft_tokens))

    def hf(self, model: str):
        """The target in transformers (float32, eager attention), loaded once."""
        def load(_path):
            import torch
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(
                str(self.target(model).path), dtype=torch.float32, attn_implementation="eager").eval()

        return self._once(f"{model}-hf", load)

    def config(self, case: Case) -> EngineConfig:
        draft = self.draft(case)
        return EngineConfig(
            key=case.key, model=case.model, target=str(self.target(case.model).path),
            draft=str(draft) if draft else None, algorithm=case.algorithm, topk=case.topk,
            num_steps=case.steps, num_draft_tokens=case.draft_tokens, extra=(("dtype", case.dtype),),
        )


@dataclass
class Run:
    case: Case
    singles: list[dict[str, Any]] = field(default_factory=list)   # one output per prompt
    batch: list[dict[str, Any]] = field(default_factory=list)     # the batched outputs, in order
    events: list[dict[str, Any]] = field(default_factory=list)    # the probe's records

    def ids(self, how: str) -> list[list[int]]:
        return [o["output_ids"] for o in (self.singles if how == "single" else self.batch)]


class Runs:
    """Each configuration run once (its failure kept and raised again for its tests)."""

    def __init__(self, session: Session, ckpts: Checkpoints) -> None:
        self.session = session
        self.ckpts = ckpts
        self._runs: dict[str, Run | EngineError] = {}

    def get(self, key: str) -> Run:
        if key not in self._runs:
            self._runs[key] = self._run(CASES[key])
        got = self._runs[key]
        if isinstance(got, EngineError):
            raise got
        return got

    def _run(self, case: Case) -> Run | EngineError:
        record = self.ckpts.root / f"{case.key}.probe.jsonl"
        record.unlink(missing_ok=True)
        try:
            self.session.ensure(self.ckpts.config(case), probe=record)
            run = Run(case)
            for prompt in PROMPTS:
                run.singles += self.session.generate(tokenizer.text(list(prompt)), sampling(prompt))
            run.batch = self.session.generate([tokenizer.text(list(p)) for p in PROMPTS],
                                              [sampling(p) for p in PROMPTS])
        except EngineError as exc:
            return exc
        run.events = probe.read(str(record))
        return run


# Tolerance of a capture against transformers (float32; bfloat16: the stream rounded to
# 8 mantissa bits at every op), relative to the row's largest value (compare_rows).
TOLERANCE = {"float32": (2e-4, 2e-4), "bfloat16": (5e-2, 5e-2)}


def capture_mismatches(run: Run, ckpts: Checkpoints) -> tuple[int, list[str]]:
    """Every target forward the probe recorded (``captures`` events: extend and
    target-verify), each request's rows against transformers on the token sequence that
    request's rows were computed on: its prompt up to the row (extend), or the tokens it
    had committed then, followed by the row's tree path of draft tokens (verify:
    ``ancestors``; a chain without a tree mask). Returns (rows checked, problems)."""
    from harness.e2e.features import compare_rows, hf_rows

    case = run.case
    target = ckpts.target(case.model)
    model = ckpts.hf(case.model)
    layers = target.layers
    indices = [j + 1 for j in case.aux_ids]  # EAGLE3 / DFlash: id j is hidden_states[j + 1]
    capture = case.final_layer_capture or "pre_norm"
    slots = ["the last layer's" if j == layers - 1 else f"id {j}'s" for j in case.aux_ids]
    atol, rtol = TOLERANCE[case.dtype]
    full = {tuple(p): list(p) + out["output_ids"] for p, out in zip(PROMPTS, run.singles)}
    cache: dict[tuple[int, ...], Any] = {}

    def row(context: list[int]):
        key = tuple(context)
        if key not in cache:
            rows = hf_rows(model, context, indices, layers, capture)
            for k in range(1, len(context) + 1):
                cache.setdefault(key[:k], rows[k - 1])
        return cache[key]

    import torch

    owner: dict[int, tuple[int, ...]] = {}
    checked, problems = 0, []
    for n_event, ev in enumerate(e for e in run.events if e["event"] == "captures"):
        offset = 0
        for pool, length in ev["segments"]:
            ids = ev["input_ids"][offset:offset + length]
            pos = ev["positions"][offset:offset + length]
            got = torch.tensor(ev["rows"][offset:offset + length], dtype=torch.float32)
            anc = ev["ancestors"][offset:offset + length] if ev["ancestors"] else None
            offset += length
            where = f"forward {n_event} ({ev['mode']}, req slot {pool}, positions {pos[0]}..{pos[-1]})"
            if ev["mode"] == "EXTEND":
                prompt = next((p for p in full if pos[0] == 0 and tuple(ids) == p), None)
                if prompt is None:
                    problems.append(f"{where}: tokens {ids} are no prompt's")
                    continue
                owner[pool] = prompt
                contexts = [full[prompt][:q + 1] for q in pos]
            elif ev["mode"] == "TARGET_VERIFY":
                if pool not in owner:
                    problems.append(f"{where}: no extend forward of this request before")
                    continue
                committed = full[owner[pool]][:pos[0]]
                paths = anc or [list(range(r + 1)) for r in range(length)]
                contexts = [committed + [ids[a] for a in sorted(path, key=lambda a: pos[a])] for path in paths]
                bad = [r for r, c in enumerate(contexts) if len(c) != pos[r] + 1]
                if bad:
                    problems.append(f"{where}: rows {bad}: tree paths do not reach their positions")
                    continue
            else:
                problems.append(f"{where}: a target forward of mode {ev['mode']}")
                continue
            want = torch.stack([row(c) for c in contexts])
            problem = compare_rows(got, want, checkpoints.H, slots, atol, rtol)
            checked += length
            if problem:
                problems.append(f"{where}: {problem}")
    return checked, problems


def platform_refusal(error: EngineError) -> str | None:
    """The reason when SGLang itself refuses the configuration on this device (its
    platform gate, before any process starts), else None. SGLang 0.5.23's
    ``srt/arg_groups/speculative_hook.py`` ``_handle_dflash`` accepts DFLASH only on cuda,
    npu and xpu (or an out-of-tree platform that declares it): "DFLASH speculative
    decoding is not supported by CpuSRTPlatform on device 'cpu'"."""
    text = str(error)
    marker = "speculative decoding is not supported by "
    if marker not in text or "on device 'cpu'" not in text:
        return None
    line = next(ln for ln in text.splitlines() if marker in ln)
    return line[line.index("ValueError: ") + len("ValueError: "):] if "ValueError: " in line else line


def accept_length(meta: dict[str, Any]) -> float:
    """1 + accepted draft tokens per verify round, from a request's ``meta_info``."""
    rounds = int(meta.get("spec_verify_ct", 0))
    accepted = int(meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts", 0)))
    return 1.0 + accepted / rounds if rounds else 0.0
