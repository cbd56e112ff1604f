"""The description of a PR bundle made on another base (``pr-export BASE=0.5.23``), in
SGLang's pull-request template: Motivation, Modifications, Related, Accuracy Tests,
Benchmarking and Tests, Checklist.

What it reads from the series commit: the ``Bug:`` paragraphs (Motivation, without the
label), ``Fix:`` (Modifications), ``Related:`` (the patch's own threads). What it adds:
the files changed, the PRs to merge first (by title), how the PR relates to each
upstream thread on aux hidden state capture (:data:`THREADS`), and the result of its
unit test on a clean checkout without and with the change. The fork's trailers,
``Fork-Testing:`` and its paths never reach it (:func:`strip_trailers` drops them,
:func:`fork_markers` says where one is left; pr-export refuses such a body).
"""

from __future__ import annotations

import re
from typing import Any

# Labels of the series' commit paragraphs; a paragraph starting with one ends the one
# before it.
_SECTION = r"(?:\n\n[A-Z][A-Za-z-]+:|\Z)"

# The upstream threads every bundle states its relation to: (number, state, what it is).
THREADS = (
    (28956, "merged, v0.5.17", "`AuxHiddenStatePacker`, and deepseek_v2 moved to it"),
    (32206, "open", "Qwen3.5: capture the last layer (the stream entering the final norm)"),
    (39286, "open", "Gemma 3: capture the layer output, not the FFN output"),
    (39776, "closed, not merged", "MiMo-V2: the last capture after the final norm"),
    (40159, "open", "Kimi-K3: one aux output buffer across decode CUDA graph sizes"),
    (33444, "open", "`AuxCaptureSink`: a fused capture sink for breakable/full prefill "
                    "CUDA graphs, a competing design for the capture handoff"),
)

# How a PR of each kind relates to each thread.
_RELATION = {
    "packer": {
        28956: "builds on it: moves more models onto the same packer",
        40159: "the same goal for these models, through the buffer the decode graph "
               "already shares (`aux_hidden_states_buffer`) rather than a new one",
        33444: "an alternative to it for these models: if it lands first, this migration "
               "is redone on its sink (the same one-buffer-per-forward contract)",
    },
    "final-layer": {
        28956: "writes the last layer's capture into its packer where the model packs",
        32206: "overlaps it in qwen3_5.py with the same value (pre-norm); whichever lands "
               "first, the other rebases",
        39776: "keeps pre-norm, the value gpt_oss already gives (#32334); the `post_norm` "
               "capture it asked for is a separate PR (`final_layer_capture`)",
    },
    # The PR that adds the choice itself.
    "final-layer-choice": {
        28956: "writes the `post_norm` capture into its packer where the model packs",
        32206: "keeps its value (pre-norm) as the default",
        39776: "gives what it asked for as a choice (`final_layer_capture: post_norm`); "
               "pre-norm stays the default",
    },
    "gemma3": {
        39286: "overlaps it in gemma3_causal.py; whichever lands first, the other rebases",
    },
}
_DEFAULT_RELATION = {
    28956: "uses it unchanged",
    33444: "independent of the capture handoff it replaces",
}

FINAL_LAYER_IDS = frozenset({"models-capture-final-layer", "dsv2-capture-final-layer"})
FINAL_LAYER_CHOICE_IDS = frozenset({"final-layer-capture", "post-norm-ignored-warning"})

# The series' own trailers, which an upstream body drops.
INTERNAL_TRAILERS = ("Patch-Id", "Origin", "Forwarded", "Upstream-Status", "Drop-In", "Upstream-Probe")
# Paragraphs of a series body that only the fork reads; pr-export drops them.
FORK_SECTIONS = ("Fork-Testing:",)
# This repository's paths and make targets, which an upstream body must not name.
FORK_PATH = re.compile(r"tests/(?:multirank|patches|parity|e2e|memory|upstream|standins)/\S*"
                       r"|make [a-z-]+|harness/\S+|BASE=\S+")
# What a bundle body must not carry: the fork's trailers and sections, its paths and
# targets, and this machine's paths.
_FORK_MARKERS = re.compile(
    "^(?:" + "|".join(INTERNAL_TRAILERS + tuple(x.rstrip(":") for x in FORK_SECTIONS)) + "):"
    "|" + FORK_PATH.pattern + r"|/work/\S+|\bauxcap\b",
    re.M,
)


def strip_trailers(body: str) -> str:
    """Commit body without our internal trailer paragraph and the fork-only paragraphs
    (``Fork-Testing:``: the fork's own tests, which mean nothing upstream)."""
    paras = body.strip().split("\n\n")
    if paras:
        last = paras[-1].splitlines()
        if last and all(re.match(r"^[A-Za-z][A-Za-z0-9-]*:\s", x) for x in last):
            kept = [x for x in last if x.split(":", 1)[0] not in INTERNAL_TRAILERS]
            paras = paras[:-1] + (["\n".join(kept)] if kept else [])
    paras = [x for x in paras if not x.startswith(FORK_SECTIONS)]
    return "\n\n".join(paras).strip()


def fork_paths(body: str) -> list[str]:
    """What an upstream body must not name: this repository's paths and make targets."""
    return sorted(set(FORK_PATH.findall(body)))


def kind(patch_id: str) -> str:
    """The bundle's kind for :data:`_RELATION`: a packer migration, a last-layer capture
    change, a Gemma 3 change, or another capture change."""
    if "aux-packer" in patch_id:
        return "packer"
    if patch_id in FINAL_LAYER_IDS:
        return "final-layer"
    if patch_id in FINAL_LAYER_CHOICE_IDS:
        return "final-layer-choice"
    if patch_id.startswith("gemma3-"):
        return "gemma3"
    return "capture"


def relation(patch_id: str, number: int) -> str:
    own = _RELATION.get(kind(patch_id), {})
    return own.get(number) or _DEFAULT_RELATION.get(number) or "independent of it"


def thread_lines(patch_id: str) -> list[str]:
    """The threads this PR has a relation of its own to, as a table, then the others in
    one line (a table of rows that each say "independent" tells a reviewer nothing)."""
    own = _RELATION.get(kind(patch_id), {})
    rows = [(n, state, what) for n, state, what in THREADS if n in own]
    rest = [f"#{n} ({what})" for n, _, what in THREADS if n not in own]
    lines: list[str] = []
    if rows:
        lines += ["| thread | state | what it is | this PR |", "|---|---|---|---|"]
        lines += [f"| #{n} | {state} | {what} | {relation(patch_id, n)} |" for n, state, what in rows]
        lines += [""]
    if rest:
        lines += [f"{'Otherwise independent' if rows else 'Independent'} of the other open or recent "
                  f"work on aux hidden state capture: {'; '.join(rest)}.", ""]
    return lines


def section(body: str, label: str) -> str:
    """The text of the ``label:`` paragraphs of a commit body, without the label."""
    m = re.search(rf"(?ms)^{label}:\s*(.+?){_SECTION}", body)
    if not m:
        return ""
    text = m.group(1).strip()
    return text[:1].upper() + text[1:]


def motivation(body: str) -> str:
    """What precedes ``Fix:``, the ``Bug:`` or ``Motivation:`` label dropped."""
    text = body.split("\n\nFix:")[0].strip()
    text = re.sub(r"^(?:Bug|Motivation):\s*", "", text)
    return text[:1].upper() + text[1:]


def fork_markers(text: str) -> list[str]:
    """What in ``text`` belongs to the fork, not to an upstream PR."""
    return sorted(set(m.group(0) for m in _FORK_MARKERS.finditer(text)))


def gpu_check_lines(bundle: str, release: str) -> list[str]:
    """The bundle's GPU check, as a reviewer runs it (``harness.suites.acceptance``)."""
    from harness.suites.acceptance import body_lines

    return body_lines(bundle, release)


def _accuracy(patch_id: str) -> list[str]:
    if kind(patch_id) == "packer":
        return ["No change of values: the packed buffer holds the K captures `torch.cat` "
                "gave, in the same order (the unit test compares them). The target's "
                "logits are not touched."]
    return ["The target's logits are not touched: this changes what the aux hidden "
            "state capture returns (or when it refuses a request), which the unit test "
            "below checks on CPU. Not yet run on a GPU: the GPU check below is the "
            "command that does."]


def base_description(p: Any, release: str, test_path: str, deps: list, stat: str,
                     without: dict, with_patch: dict, body: str | None = None) -> str:
    """The bundle's description.md. ``p``: the series patch or bundle (``subject``,
    ``id``, and ``body`` unless ``body``, the upstream commit body, is given); ``deps``:
    what to merge first (``subject``); ``without``/``with_patch``: the unit test's runs
    on a clean checkout (``rc``, ``summary``, ``tail``)."""
    body = strip_trailers(p.body) if body is None else body
    lines = [f"# {p.subject}", "", "## Motivation", "", motivation(body), ""]
    lines += ["## Modifications", ""]
    fix = section(body, "Fix")
    if fix:
        lines += [fix, ""]
    lines += [f"Based on v{release}. Files:", "", "```", stat, "```", ""]
    if deps:
        lines += ["Stacked on (merge first):", ""] + [f"- {q.subject}" for q in deps] + [""]
    lines += ["## Related", ""]
    own = section(body, "Related")
    if own:
        lines += [own, ""]
    lines += thread_lines(p.id)
    lines += ["## Accuracy Tests", "", *_accuracy(p.id), ""]
    lines += gpu_check_lines(p.id, release)
    lines += ["## Benchmarking and Tests", "",
              f"New unit test `{test_path}` (CPU only, `register_cpu_ci`; runs as "
              f"`python3 {test_path}`). On a clean checkout of v{release} "
              "(`git apply --check`: OK):", ""]
    for label, res in ((f"without this change (v{release})", without), ("with this change", with_patch)):
        verdict = "passes" if res["rc"] == 0 else "fails"
        lines += [f"- {label}: {verdict} (exit {res['rc']}, `{res['summary']}`)", "", "```", *res["tail"], "```", ""]
    if kind(p.id) == "packer":
        lines += ["Memory: the K captures and their concatenation no longer coexist (one "
                  "[T, K * H] buffer instead of K captures plus their `torch.cat`). No "
                  "throughput run on a GPU.", ""]
    lines += ["## Checklist", "",
              "- [x] Format your code according to the pre-commit config (ruff, codespell "
              "at the versions of this release).",
              "- [x] Add unit tests (CPU, registered with `register_cpu_ci`).",
              "- [ ] Update documentation / docstrings as needed (none needed).",
              "- [ ] Provide throughput / latency benchmark results and accuracy evaluation "
              "results as needed (see above: CPU unit tests only)."]
    return "\n".join(lines).rstrip() + "\n"
