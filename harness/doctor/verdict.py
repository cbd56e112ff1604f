"""The verdict per slot, the conventions the features show, and the one change that
fixes a mismatch (stdlib only).

A slot *matches* when the term this server feeds it is the term the features hold.
Otherwise the fix is, by what differs:

* the layer: the capture ids, as the draft config key SGLang reads for the method
  (``eagle_config.eagle_aux_hidden_state_layer_ids``, ``dflash_config.target_layer_ids``,
  ``dspark_target_layer_ids``). The new ids come from the offset this server applies to
  an id (observed: deepseek_v2 adds 1 only when the first id is 1), and are verified by
  serving them;
* the side of the final norm: ``final_layer_capture`` in the draft config, or
  ``--speculative-final-layer-capture``;
* the side of the deepstack addition: ``deepstack_capture``, or
  ``--speculative-deepstack-capture``;
* the residual left out (``branch[i]``): no setting feeds it; the draft must be
  retrained on features this server produces.

Each proposed change is served again (:mod:`harness.doctor.served`) and counts as the
fix only when every slot then holds what the features hold.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.doctor.declared import Declaration, Finding

FINAL = "final_layer_capture"
DEEPSTACK = "deepstack_capture"


@dataclass
class Slot:
    slot: int
    id: Optional[int]               # the id SGLang reads for this slot (None: the default ids)
    serves: Any = None              # terms.Match of this server's capture
    pristine: str = ""
    vllm: str = ""
    trained: Any = None             # terms.Match of the features' slot, or None
    verdict: str = "unverified"     # "match" | "mismatch" | "unverified" | "refused"
    why: str = ""
    fix: str = ""

    def to_json(self, layers: int) -> dict[str, Any]:
        return {"slot": self.slot, "id": self.id,
                "serves": self.serves.to_json() if self.serves else None,
                "pristine": self.pristine, "vllm": self.vllm,
                "trained": self.trained.to_json() if self.trained else None,
                "verdict": self.verdict, "why": self.why, "fix": self.fix}


@dataclass
class Report:
    base: str
    target: Any                    # target.Target
    draft: Declaration
    served: Any                    # served.Served, as configured
    served_dtype: str = ""
    trained: Any = None            # features.Trained
    slots: list[Slot] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    conventions: dict[str, str] = field(default_factory=dict)
    change: dict[str, Any] = field(default_factory=dict)    # the one change, and whether verified
    candidates: list[Any] = field(default_factory=list)     # served.Served of each proposed fix
    rules: list[dict[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.served.refused:
            return "refused"
        if any(f.severity == "error" for f in self.findings) or any(s.verdict == "mismatch" for s in self.slots):
            return "mismatch"
        return "match" if self.trained is not None else "unverified"

    def to_json(self) -> dict[str, Any]:
        layers = self.target.layers
        return {
            "base": self.base, "verdict": self.verdict, "target": self.target.to_json(),
            "draft": self.draft.to_json(), "served_dtype": self.served_dtype,
            "served": self.served.to_json(), "trained": self.trained.to_json() if self.trained else None,
            "slots": [s.to_json(layers) for s in self.slots],
            "findings": [f.to_json() for f in self.findings], "conventions": self.conventions,
            "change": self.change, "candidates": [c.to_json() for c in self.candidates],
            "rules": self.rules,
        }


def _key(m) -> Optional[str]:
    return m.term.key() if m is not None and m.term is not None else None


def assess(report: Report, pristine: list[str], vllm: list[str]) -> None:
    """Fill in the slots, conventions and findings of ``report`` (served and trained set)."""
    decl, served, trained = report.draft, report.served, report.trained
    report.findings = list(decl.findings)
    ids = decl.ids
    k_served = len(served.slots)
    k = max(k_served, len(trained.slots) if trained else 0, len(pristine))
    for i in range(k):
        slot = Slot(i, ids[i] if ids is not None and i < len(ids) else None,
                    served.slots[i] if i < k_served else None,
                    pristine[i] if i < len(pristine) else "", vllm[i] if i < len(vllm) else "",
                    trained.slots[i] if trained and i < len(trained.slots) else None)
        report.slots.append(slot)
        if served.refused:
            slot.verdict, slot.why = "refused", served.refused
        elif slot.serves is not None and slot.serves.term is None:
            slot.verdict = "mismatch"
            slot.why = (f"this server's capture is no transformers term of the target (closest "
                        f"{slot.serves.best.key()}, error {slot.serves.error:.2g}): a capture bug")
        elif trained is None:
            continue
        elif slot.trained is None or slot.serves is None:
            slot.verdict = "mismatch"
            slot.why = (f"the server feeds {k_served} captures, the features hold {len(trained.slots)}")
        elif slot.trained.term is None:
            slot.verdict = "mismatch"
            slot.why = (f"the features' slot is no transformers term of this target (closest "
                        f"{slot.trained.best.key()}, error {slot.trained.error:.2g}): other weights, "
                        "or another model")
        elif _key(slot.trained) == _key(slot.serves):
            slot.verdict = "match"
            if slot.trained.ambiguous:
                slot.why = (f"ambiguous: {slot.trained.runner_up.key()} is almost as close "
                            f"({slot.trained.runner_up_error:.2g})")
        else:
            slot.verdict = "mismatch"
            slot.why = f"trained on {_key(slot.trained)}, served {_key(slot.serves)}"
    if trained is not None:
        report.conventions = conventions(report)
    else:
        report.findings += advisories(report)
    if report.served_dtype and trained is not None and trained.dtype not in report.served_dtype:
        report.findings.append(Finding(
            "info", f"the features are {trained.dtype}, this server captures in {report.served_dtype}"))
    if trained is not None and trained.hidden_state is not None:
        hs = trained.hidden_state
        if hs.term is None:
            report.findings.append(Finding(
                "warning", f"the features' hidden_state is no transformers term of this target (closest "
                f"{hs.best.key()}, error {hs.error:.2g}): are these the target's weights?"))


def advisories(report: Report) -> list[Finding]:
    """Without features: where the draft's config means different values to this server
    and to the others a draft may have been trained on."""
    out = []
    layers = report.target.layers
    served = [_key(s.serves) for s in report.slots]
    vllm = [s.vllm for s in report.slots]
    if served and None not in served and vllm != served and len(vllm) == len(served):
        out.append(Finding(
            "warning", f"this server feeds {', '.join(served)}; vLLM reads the same config as "
            f"{', '.join(vllm)}: a draft trained on features collected the other way accepts less here",
            "run the doctor with FEATURES (the draft's training features) to tell which it was trained on"))
    if f"hidden_states[{layers}]" not in served and "pre_norm" in served:
        out.append(Finding(
            "info", "the last slot is the last layer's output before the final norm (pre_norm): features from "
            "transformers' output_hidden_states hold it after the norm (post_norm, as MiMo's DFlash and NeMo "
            "AutoModel's DSpark drafts were trained)",
            "if the draft was trained so, set final_layer_capture: post_norm (FEATURES tells)"))
    return out


def _declared_ids(decl: Declaration) -> Optional[list[int]]:
    """The ids the draft names in any key (SGLang's first, then the others)."""
    if decl.ids is not None:
        return decl.ids
    return next(iter(decl.all_ids.values()), None)


def conventions(report: Report) -> dict[str, str]:
    """What the features show, in the ecosystem's words: the ids' meaning, the last
    layer's side of the final norm, the deepstack side, the residual, the norm keys."""
    layers, decl = report.target.layers, report.draft
    trained = [s.trained.term for s in report.slots if s.trained is not None]
    out: dict[str, str] = {}
    named = _declared_ids(decl)
    idx = [t.index if t is not None else None for t in trained]
    if None not in idx and idx:
        if named is None:
            out["ids"] = "default" if idx == [2, layers // 2, layers - 3] else f"other {idx}"
        elif len(named) == len(idx) and all(t == i + 1 for t, i in zip(idx, named)):
            out["ids"] = "sglang" if decl.method == "EAGLE3" else "layer_output"
        elif len(named) == len(idx) and all(t == i for t, i in zip(idx, named)):
            out["ids"] = "vllm" if decl.method == "EAGLE3" else "layer_input"
        else:
            out["ids"] = f"other {idx}"
    for t in trained:
        if t is None:
            continue
        if t.index == layers:
            out["final_layer"] = {"hs": "post_norm", "pre_norm": "pre_norm"}.get(t.kind, t.kind)
    if report.trained.image_rows and report.target.deepstack_layers:
        depth = len(report.target.deepstack_layers)
        sides = {("post_deepstack" if t.kind == "post_deepstack" else "pre_deepstack")
                 for t in trained if t is not None and 1 <= t.index <= depth and t.kind in ("hs", "post_deepstack")}
        if len(sides) == 1:
            out["deepstack"] = sides.pop()
        elif sides:
            out["deepstack"] = "mixed"
    out["residual"] = "without" if any(t is not None and t.kind == "branch" for t in trained) else "with"
    for f in decl.findings:
        if "no key turns" in f.what and "input_norm" in f.what:
            out["norm_before_fc"] = "tensors_without_key"
        elif f.what.startswith("norm_before_fc is true"):
            out["norm_before_fc"] = "key_without_tensors"
        elif "no key" in f.what and "fc_norm" in f.what:
            out["fc_norm"] = "tensors_without_key"
    return out


# ----------------------------------------------------------------------------- fixes


@dataclass
class Proposal:
    """A change to try: draft config keys to set (dotted) and/or server flags."""

    config: dict[str, Any]
    flags: dict[str, str]
    label: str


def proposals(report: Report) -> tuple[list[Proposal], dict[int, str]]:
    """The changes that could make every mismatched slot hold what it was trained on
    (tried in order), and per slot the reason none can where that is so."""
    decl, layers = report.draft, report.target.layers
    depth = len(report.target.deepstack_layers)
    bad = [s for s in report.slots if s.verdict in ("mismatch", "refused")]
    if not bad or report.trained is None:
        return [], {}
    unfixable: dict[int, str] = {}
    final: set[str] = set()
    deep: set[str] = set()
    for s in bad:
        t = s.trained.term if s.trained is not None else None
        if s.verdict == "refused" and (s.trained is None or s.trained.term is None):
            unfixable[s.slot] = f"SGLang refuses the draft at start-up: {s.why}"
        elif s.verdict == "refused":
            continue
        elif s.serves is None or s.trained is None:
            unfixable[s.slot] = "name as many ids as the features hold captures (or retrain)"
        elif s.serves.term is None:
            unfixable[s.slot] = "none on the draft's side: this server's capture is wrong (report it)"
        elif t is None:
            unfixable[s.slot] = "none: check that FEATURES were made from this target's weights"
        elif t.kind == "branch":
            unfixable[s.slot] = ("retrain the draft on features from this server (--enable-return-aux-"
                                 "hidden-states): no setting serves a capture without the residual")
    for s in report.slots:
        t = s.trained.term if s.trained is not None else None
        if t is None or s.slot in unfixable:
            continue
        if t.index == layers and t.kind in ("hs", "pre_norm"):
            final.add("post_norm" if t.kind == "hs" else "pre_norm")
        if depth and 1 <= t.index <= depth and report.trained.image_rows:
            deep.add("post_deepstack" if t.kind == "post_deepstack" else "pre_deepstack")
    if len(final) > 1 or len(deep) > 1:
        for s in bad:
            unfixable.setdefault(s.slot, "the slots were trained on both sides of one setting: "
                                         "no single setting serves them")
    if len(unfixable) == len(bad):
        return [], unfixable
    settings: dict[str, str] = {}
    if final:
        side = final.pop()
        if side != ((report.served.resolved or {}).get(FINAL) or "pre_norm"):
            settings[FINAL] = side
    if deep:
        side = deep.pop()
        served_sides = {"post_deepstack" if s.serves.term.kind == "post_deepstack" else "pre_deepstack"
                        for s in report.slots
                        if s.serves is not None and s.serves.term is not None and 1 <= s.serves.term.index <= depth}
        if served_sides != {side}:
            settings[DEEPSTACK] = side
    layer_moves = report.served.refused is not None or any(
        s.trained and s.serves and s.trained.term and s.serves.term
        and s.trained.term.index != s.serves.term.index for s in bad)
    out: list[Proposal] = []
    if layer_moves:
        for ids in _candidate_ids(report):
            config = {decl.ids_key_for_fix(): ids}
            config.update({decl.settings_key(k): v for k, v in settings.items()})
            out.append(Proposal(config, {}, f"ids {ids}"))
    elif settings:
        out.append(Proposal({decl.settings_key(k): v for k, v in settings.items()}, {}, "draft config"))
        out.append(Proposal({}, {f"--speculative-{k.replace('_', '-')}": v for k, v in settings.items()},
                            "server flags"))
    return out, unfixable


def _candidate_ids(report: Report) -> list[list[int]]:
    """New ids that would serve each slot's trained layer: from the offset this server
    applied to each slot's id (observed), then the offsets 1 (SGLang's EAGLE3 and DFlash)
    and 0 (deepseek_v2's first id other than 1)."""
    layers, out = report.target.layers, []
    wanted, offsets = [], []
    for s in report.slots:
        t = s.trained.term if s.trained is not None else None
        if t is None:
            return []
        wanted.append(t.index)
        served = s.serves.term if s.serves is not None else None
        offsets.append(served.index - s.id if served is not None and s.id is not None else None)
    for rule in ("observed", 1, 0):
        ids = []
        for want, off in zip(wanted, offsets):
            off = (off if off is not None else 1) if rule == "observed" else rule
            ids.append(want - off)
        if all(0 <= i < layers for i in ids) and ids not in out:
            out.append(ids)
    return out


def write_config(decl: Declaration, proposal: Proposal, directory: Path) -> Path:
    """A draft directory holding only ``config.json``: the draft's, with ``proposal``'s
    keys set (what the resolvers read; no weights needed)."""
    config = copy.deepcopy(decl.config)
    for dotted, value in proposal.config.items():
        holder = config
        *parents, leaf = dotted.split(".")
        for p in parents:
            holder = holder.setdefault(p, {})
        holder[leaf] = value
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def record(report: Report, tried: list[tuple[Proposal, Any]], unfixable: dict[int, str]) -> None:
    """Per mismatched slot its fix, and the one change: the first proposal whose served
    slots all hold the trained terms (verified), else the first proposed."""
    want = [_key(s.trained) for s in report.slots]
    report.candidates = [served for _, served in tried]
    verified = [(p, served) for p, served in tried
                if not served.refused and [_key(m) for m in served.slots] == want]
    chosen = verified[0] if verified else (tried[0] if tried and not report.served.refused else None)
    if chosen is not None:
        proposal, served = chosen
        report.change = {
            "draft_config": proposal.config, "server_flags": proposal.flags,
            "verified": bool(verified),
            "serves_then": [_key(m) for m in served.slots] if not served.refused else served.refused,
        }
        alt = [p for p, s in verified if p is not proposal]
        if alt:
            report.change["or"] = {"draft_config": alt[0].config, "server_flags": alt[0].flags}
    for s in report.slots:
        if s.verdict not in ("mismatch", "refused"):
            continue
        if s.slot in unfixable:
            s.fix = unfixable[s.slot]
        elif chosen is not None:
            s.fix = describe_change(report.change)
        elif s.verdict == "refused":
            s.fix = "change what SGLang refuses (above); no change of ids or settings was found that it serves"


def describe_change(change: dict[str, Any]) -> str:
    parts = [f"set {k} = {json.dumps(v)} in the draft's config.json" for k, v in change.get("draft_config", {}).items()]
    parts += [f"serve with {k} {v}" for k, v in change.get("server_flags", {}).items()]
    text = "; ".join(parts)
    alt = change.get("or")
    if alt:
        alt_parts = [f"{k} {v}" for k, v in alt.get("server_flags", {}).items()]
        alt_parts += [f"{k} = {json.dumps(v)}" for k, v in alt.get("draft_config", {}).items()]
        text += f" (or: {'; '.join(alt_parts)})"
    if change and change.get("verified"):
        text += " [verified: served so, every slot holds what it was trained on]"
    elif change:
        then = change.get("serves_then")
        then = ", ".join(then) if isinstance(then, list) else then
        text += f" [not verified: served so, the slots hold {then}]"
    return text
