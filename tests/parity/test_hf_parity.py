"""HF parity: every capturing family that transformers implements, against transformers.

For each family (``harness/parity/families``): a tiny random-weight transformers
checkpoint is written with ``save_pretrained``; SGLang loads it through its own
``ModelConfig`` and model loader at TP = 1 and TP = 2 (gloo), requests captures
through the function the model runner calls (EAGLE3 ids ``1 .. L-1``, DFlash ids
``0, L // 2, L - 1``; both hold the last layer) and runs an extend batch of two
prompts on its CPU paths (``torch_native`` attention). At TP = 2 the norms alias like
the CUDA kernels, and where the family's layers defer their all-reduce the FlashInfer
fusion emulation runs too. Checked against transformers:

* ``test_final_and_logits``: the final hidden states (every token) and the next-token
  logits, with nothing captured;
* ``test_in_loop_captures``: capture ``k`` at index ``i < L`` equals transformers'
  ``hidden_states[i]`` (the stream entering layer ``i``), the setter mapped draft
  layer id ``j`` to index ``j + 1``, and capturing left the final hidden states as
  they are without it;
* ``test_last_layer_capture``: K of K reach the logits processor's output (what the
  draft receives), and the capture of index ``L`` equals the stream entering
  transformers' final norm (``pre_norm``, the default last-layer semantics) or, with
  the draft config's ``final_layer_capture: post_norm`` (set ``post_norm``: the EAGLE3
  ids), transformers' ``hidden_states[L]``, the final norm's output.

After the extend, the same loaded model runs later forwards over the requests' cache
(``harness.parity.runner.MODES``): a decode batch (one token per request), an EAGLE
verify batch (a chain of ``VERIFY_TOKENS`` per request, topk 1, through the triton
backend as SGLang's CPU engine verifies) and an idle batch (no tokens). Checked against
transformers on each request's whole token sequence, at the rows each forward holds:

* ``test_mode``, for every capture set and forward: the final hidden states and the
  next-token logits, and the whole packed capture output, K of K, each slot against
  ``hidden_states[i]`` or the last layer's value as above (an idle batch: empty, of the
  right widths: ``[0, H]``, ``[0, vocab]``, ``[0, K * H]``; no captures at all where
  the model's spec says it hands on none for one, ``idle_captures``). The set without
  captures runs no later forward: each set's final hidden states are checked there.

Where SGLang cannot run a forward on the CPU (``Family.cannot_run``) or disagrees with
transformers outside the captures (``Family.known_failures``), the case is a strict
expected failure naming SGLang's file:line.

Guards follow the survey's bugs (``harness.standins.models``): a case guards the patch
that fixes the bug it exercises on the active base, so `make ablation` shows it
failing without that patch.
"""

from __future__ import annotations

import pytest
import torch

from harness.parity import reference
from harness.parity.families import BOTH_BASES, families
from harness.parity.runner import ENV, EXTEND_ONLY, INIT_FN, MODES, PRELOAD

pytestmark = [pytest.mark.bases(*BOTH_BASES), pytest.mark.parity]

TPS = (1, 2)
SETS = ("none", "eagle3", "dflash", "post_norm")
EAGLE3_SETS = ("eagle3", "post_norm")
# The patch that lets the draft choose the last layer's capture (docs/MODELS.md).
FINAL_LAYER_CAPTURE = "final-layer-capture"
# The patch that makes SGLang's fallback right where FlashInfer declines a deferred
# layer's fused norm (all-reduce, then the norm into a residual of its own), per base:
# 0.5.23's own fallback does both.
DECLINED_FALLBACK = {BOTH_BASES[0]: "fused-norm-fallback"}


def _active(fam) -> bool:
    from harness.patchset.layout import layout

    return layout().label in fam.bases


def capture_request(set_name: str, num_layers: int) -> dict:
    """What the model runner passes for each capture set (draft layer ids)."""
    if set_name == "eagle3":
        return {"eagle3": list(range(1, num_layers))}
    if set_name == "dflash":
        return {"dflash": [0, num_layers // 2, num_layers - 1]}
    if set_name == "post_norm":
        return {"eagle3": list(range(1, num_layers)), "final_layer_capture": "post_norm"}
    return {}


def _ids(set_name: str, num_layers: int) -> list:
    """The draft layer ids a capture set requests."""
    request = capture_request(set_name, num_layers)
    return request["eagle3"] if "eagle3" in request else request["dflash"]


def sets(fam) -> tuple:
    """The capture sets of ``fam``: SETS, less the EAGLE3 ones for a DFlash-only model."""
    return SETS if fam.eagle3 else tuple(s for s in SETS if s not in EAGLE3_SETS)


def _cases():
    """(test id, family, tp, set, fusion) for every parity run of the active base."""
    out = []
    for name, fam in sorted(families().items()):
        if not _active(fam):
            continue
        for tp in TPS:
            if tp not in fam.tps:
                continue
            for set_name in sets(fam):
                for fusion in fam.variants(tp):
                    out.append((f"{name}-tp{tp}-{set_name}-{fusion}", name, tp, set_name, fusion))
    return out


CASES = _cases()


def _bugs(fam) -> frozenset:
    from harness.standins.models import specs

    spec = specs().get(fam.spec)
    return spec.bugs() if spec is not None else frozenset()


def _idle_captures(fam) -> bool:
    """Whether the family's model captures on an idle batch (``ModelSpec.idle_captures``:
    K of K empty captures), or by design hands on none."""
    from harness.standins.models import specs

    spec = specs().get(fam.spec)
    return spec is None or spec.idle_captures


def _patch_for(fam, bug: str):
    from harness.standins.models import specs

    spec = specs().get(fam.spec)
    return spec.patch_for(bug) if spec is not None else None


# The survey bugs every family's parity cases exercise (the rest: Family.also_exercises):
# A, C, R (no DFlash setter), U (no setter at all), N (final norm).
EXERCISED = frozenset({"A", "C", "R", "U", "N"})
# The aliasing variants (harness.parity.runner.VARIANTS) in which a layer defers its
# all-reduce into the next layer's norm: bug A shows there, fused or declined.
DEFERS = ("flashinfer", "declined")


def _exercised(fam) -> frozenset:
    from harness.patchset.layout import layout

    extra = fam.also_exercises | fam.also_exercises_on.get(layout().label, frozenset())
    return _bugs(fam) & (EXERCISED | extra)


def refused(fam, set_name: str) -> bool:
    """Whether the model runner refuses this capture set on the base's pristine tree
    (no setter at all, "U", or no DFlash setter, "R")."""
    bugs = _exercised(fam)
    return set_name != "none" and ("U" in bugs or (set_name == "dflash" and "R" in bugs))


def case_bugs(fam, kind: str, tp: int, set_name: str, fusion: str) -> list[str]:
    """The survey bugs a parity test exercises: what its guards follow. A set the model
    runner refuses at the base shows only that (its captures never run)."""
    bugs = _exercised(fam)
    if kind == "final":
        return [b for b in ("N",) if b in bugs]
    if refused(fam, set_name):
        return [b for b in ("U", "R") if b in bugs][:1]
    wanted = []
    if kind == "in_loop" and tp > 1 and fusion in DEFERS:
        wanted.append("A")
    if kind == "last":
        wanted.append("C")
    if set_name in ("eagle3", "post_norm"):
        wanted.append("L")
    return [b for b in wanted if b in bugs]


def _marks(fam, kinds, tp: int, set_name: str, fusion: str, mode: str = "") -> list:
    """A case's marks: a strict xfail with its reason where one is known
    (:func:`_known_failure`), else the guards of the survey bugs its checks exercise
    (``kinds``: those of :func:`case_bugs`)."""
    marks = [pytest.mark.multirank, pytest.mark.world_size(tp)]
    known = _known_failure(fam, tp, mode)
    if known:
        return marks + [pytest.mark.xfail(strict=True, reason=known)]
    bugs = {b for kind in kinds for b in case_bugs(fam, kind, tp, set_name, fusion)}
    patches = {p for p in (_patch_for(fam, b) for b in bugs) if p}
    if "last" in kinds and set_name == "post_norm":
        patches.add(FINAL_LAYER_CAPTURE)
    if fusion == "declined" and mode != "idle":  # an idle batch holds no value
        from harness.patchset.layout import layout

        patches.add(DECLINED_FALLBACK.get(layout().label))
        patches.discard(None)
    return marks + [pytest.mark.guards(p) for p in sorted(patches)]


def _params(kind: str):
    for case_id, name, tp, set_name, fusion in CASES:
        if (kind == "final") != (set_name == "none"):
            continue
        marks = _marks(families()[name], (kind,), tp, set_name, fusion)
        yield pytest.param(name, tp, set_name, fusion, id=case_id, marks=marks)


def _mode_params():
    """The later forwards' cases: every capture set, each forward of MODES (its check
    covers the final hidden states, the in-loop and the last-layer captures)."""
    for case_id, name, tp, set_name, fusion in CASES:
        if set_name == "none" or fusion in EXTEND_ONLY:  # runner.EXTEND_ONLY: why
            continue
        for mode in MODES:
            marks = _marks(families()[name], ("final", "in_loop", "last"), tp, set_name,
                           fusion, mode)
            yield pytest.param(name, tp, set_name, fusion, mode, id=f"{case_id}-{mode}",
                               marks=marks)


def _known_failure(fam, tp: int, mode: str = "") -> str:
    """The reason when SGLang at the active base cannot run this family's ``mode``
    forward on the CPU (``Family.cannot_run``: ``"<base>:<mode>"``) or is known to
    disagree with transformers on it at this TP for a bug outside the captures
    (``Family.known_failures``: ``"<base>:tp<N>:<mode>"``, ``"<base>:<mode>"``, then,
    except for the idle forward, ``"<base>:tp<N>"``, ``"<base>"``); the extend's cases
    have no ``mode``."""
    from harness.patchset.layout import layout

    label = layout().label
    if mode and f"{label}:{mode}" in fam.cannot_run:
        return fam.cannot_run[f"{label}:{mode}"]
    keys = [f"{label}:tp{tp}:{mode}", f"{label}:{mode}"] if mode else []
    if mode != "idle":
        keys += [f"{label}:tp{tp}", label]
    return next((fam.known_failures[k] for k in keys if k in fam.known_failures), "")


# ------------------------------------------------------------------ fixtures

_RUNS: dict = {}


def _pool(rank_pool, tp: int, wait: bool = True):
    """The warm parity pool of ``tp`` ranks, in SGLang's CPU engine mode: forked from a
    forkserver that imported SGLang once in that mode (:mod:`harness.parity.preload`)."""
    return rank_pool(tp, backend="gloo", init_fn=INIT_FN, env=dict(ENV), timeout=1200,
                     start_timeout=900, wait=wait, preload=PRELOAD)


def _wanted_runs(session) -> dict:
    """{(family, tp): {capture set: {fusion: the later forwards (MODES) read}}}: what this
    session's selected tests read (after ``-k`` and ``--guards``). An in-loop test also
    reads the uncaptured run of its fusion. Only those sets, variants and forwards run:
    an ablation run that guards the last layer's capture does not pay for DFlash's."""
    out: dict = {}
    for item in session.items:
        spec = getattr(item, "callspec", None)
        if spec is None or not item.nodeid.split("::", 1)[0].endswith("test_hf_parity.py"):
            continue
        p = spec.params
        runs = out.setdefault((p["name"], p["tp"]), {})
        runs.setdefault(p["set_name"], {}).setdefault(p["fusion"], set())
        if "mode" in p:
            runs[p["set_name"]][p["fusion"]].add(p["mode"])
        if item.originalname == "test_in_loop_captures":
            runs.setdefault("none", {}).setdefault(p["fusion"], set())
    return out


@pytest.fixture(scope="module")
def references(selected_cases, rank_pool, tmp_path_factory, request):
    """Per selected active family: its checkpoint directory, prompts, transformers'
    outputs, and per TP the runs its selected tests read (:func:`_wanted_runs`).

    The rank pools of the selected TPs start first (each rank imports SGLang meanwhile)."""
    wanted = selected_cases("test_hf_parity.py")
    runs = _wanted_runs(request.session)
    for tp in sorted(set().union(*wanted.values())):
        _pool(rank_pool, tp, wait=False)
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for name, fam in sorted(families().items()):
        if not _active(fam) or name not in wanted:
            continue
        model = reference.make_checkpoint(fam, root / name)
        vocab_size = fam.config()["vocab_size"]
        prompts = reference.prompts(vocab_size)
        appended = reference.appended_tokens(vocab_size)
        out[name] = dict(checkpoint=str(root / name), prompts=prompts, appended=appended,
                         tps=wanted[name], ref=reference.reference(fam, model, prompts, appended),
                         runs={tp: runs.get((name, tp), {}) for tp in wanted[name]})
        del model
    return out


# Capture sets requested one after another on one loaded model: the same ids, only the
# last layer's setting differs (runner.run_case's ``then``).
FOLLOWS = {"post_norm": "eagle3"}


def _run(rank_pool, references, tp: int) -> dict:
    """Every case of this TP in one call to a warm pool of ``tp`` ranks (each loads the
    checkpoint itself: TP sharding by SGLang's own weight loaders)."""
    if tp not in _RUNS:
        keys, cases = [], []
        for name, fam in sorted(families().items()):
            if name not in references or tp not in fam.tps or tp not in references[name]["tps"]:
                continue
            # transformers' own count of decoder layers (its hidden_states), which the
            # tests use too: LongCat's config counts two attentions per layer.
            L = references[name]["ref"]["num_layers"]
            selected = references[name]["runs"][tp]
            for set_name in sets(fam):
                if set_name in FOLLOWS:
                    continue
                then = [s for s, first in FOLLOWS.items() if first == set_name]
                group = [selected.get(s, {}) for s in (set_name, *then)]
                fusions = [f for f in fam.variants(tp) if any(f in g for g in group)]
                if not fusions:
                    continue
                modes = {m for g in group for f in g.values() for m in f}
                if "verify" in modes:  # its prefix holds the decode's token
                    modes.add("decode")
                keys.append([(name, s) for s in (set_name, *then)])
                cases.append(dict(checkpoint=references[name]["checkpoint"],
                                  prompts=references[name]["prompts"],
                                  appended=references[name]["appended"],
                                  modes=[m for m in MODES if m in modes],
                                  capture=capture_request(set_name, L),
                                  then=[capture_request(s, L) for s in then],
                                  fusions=fusions, attention=fam.attention,
                                  setup=fam.setup))
        per_rank = _pool(rank_pool, tp).run("harness.parity.runner:run_family", cases)
        _RUNS[tp] = {}
        for i, case_keys in enumerate(keys):
            fusions = cases[i]["fusions"]
            for v, key in enumerate(case_keys):
                for j, fusion in enumerate(fusions):
                    _RUNS[tp][(key, fusion)] = [rank_results[i][v * len(fusions) + j]
                                                for rank_results in per_rank]
    return _RUNS[tp]


# What each aliasing variant's forwards must have run (harness.standins.kernels.PATHS):
# the FlashInfer wrapper's outcomes, and CUDA's custom all-reduce.
FLASHINFER_PATHS = ("flashinfer_fused", "flashinfer_declined")


def check_paths(variant: str, tp: int, paths: dict, what: str, tokens: bool = True) -> None:
    """Fail unless the forward took the path ``variant`` stands for: a "flashinfer" case
    fused (the CPU reference returned its result, and no call declined), a "declined"
    one fell back (the real wrapper declined, and nothing fused), any other case never
    asked FlashInfer; at TP > 1 "custom_ar" all-reduced through CUDA's custom
    all-reduce and the others never did. A forward of no tokens (``tokens`` False)
    fuses nothing and may all-reduce nothing."""
    want = {"flashinfer": "flashinfer_fused", "declined": "flashinfer_declined"}.get(variant)
    for path in FLASHINFER_PATHS:
        ran = paths.get(path, 0)
        expected = path == want and tokens
        assert (ran > 0) == expected, (
            f"{what}: {variant} case: FlashInfer's wrapper "
            f"{'fused' if path == 'flashinfer_fused' else 'declined'} {ran} times "
            f"({'expected' if expected else 'expected none'}; paths {paths})"
        )
    # Every forward of tokens normalises through SGLang's CUDA norm path over the CPU
    # kernels (harness.standins.cpu_kernels.cuda_norm), at TP 1 too.
    # (The pin's Gemma3RMSNorm has no residual form: its forward_cuda is forward_native.)
    norms = paths.get("norm_forward_cuda", 0)
    assert norms > 0 or not tokens, (
        f"{what}: {variant} case: no norm ran SGLang's CUDA path (paths {paths})")
    ran = paths.get("custom_all_reduce", 0)
    if variant == "custom_ar" and tp > 1 and tokens:
        assert ran > 0, f"{what}: custom_ar case ran no custom all-reduce (paths {paths})"
    elif variant != "custom_ar":
        assert ran == 0, f"{what}: {variant} case ran {ran} custom all-reduces (paths {paths})"


def _results(rank_pool, references, name, tp, set_name, fusion) -> list:
    fam = families()[name]
    if not _active(fam):
        pytest.skip(f"{name}: not on this base")
    per_rank = _run(rank_pool, references, tp)[((name, set_name), fusion)]
    for r, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"{name} tp{tp} {set_name} {fusion}: rank {r} raised:\n{res['error']}")
        check_paths(fusion, tp, res["paths"], f"rank {r}: the extend")
    return per_rank


def _mode_results(rank_pool, references, name, tp, set_name, fusion, mode) -> list:
    """Each rank's result of the ``mode`` forward that followed this case's extend."""
    out = []
    for r, res in enumerate(_results(rank_pool, references, name, tp, set_name, fusion)):
        got = res["modes"][mode]
        if "error" in got:
            pytest.fail(f"{name} tp{tp} {set_name} {fusion} {mode}: rank {r} raised:\n"
                        f"{got['error']}")
        check_paths(fusion, tp, got["paths"], f"rank {r}: {mode}", tokens=mode != "idle")
        out.append(got)
    return out


def _close(fam, got, want, what: str, rank: int) -> None:
    scale = max(float(want.abs().max()), 1.0)
    diff = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    assert got.shape == want.shape and diff <= fam.atol * scale + 0.0, (
        f"rank {rank}: {what} differs from transformers: max abs diff {diff:.3g} "
        f"(|ref| max {scale:.3g}, shape {tuple(got.shape)} vs {tuple(want.shape)})"
    )


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("name, tp, set_name, fusion", list(_params("final")))
def test_final_and_logits(rank_pool, references, name, tp, set_name, fusion):
    fam = families()[name]
    ref = references[name]["ref"]
    per_rank = _results(rank_pool, references, name, tp, set_name, fusion)
    for r, res in enumerate(per_rank):
        _close(fam, res["final"], ref["final"], "final hidden states", r)
        _close(fam, res["logits"], ref["logits"], "next-token logits", r)


def _slots(res, hidden: int):
    aux = res["aux"]
    if aux is None:
        return []
    return [aux[:, k * hidden:(k + 1) * hidden] for k in range(aux.shape[-1] // hidden)]


@pytest.mark.parametrize("name, tp, set_name, fusion", list(_params("in_loop")))
def test_in_loop_captures(rank_pool, references, name, tp, set_name, fusion):
    fam = families()[name]
    ref = references[name]["ref"]
    L = ref["num_layers"]
    ids = _ids(set_name, L)
    plain = _results(rank_pool, references, name, tp, "none", fusion)
    for r, res in enumerate(_results(rank_pool, references, name, tp, set_name, fusion)):
        assert torch.equal(res["final"], plain[r]["final"]), (
            f"rank {r}: capturing changed the final hidden states"
        )
        assert res["layers_to_capture"] == [j + 1 for j in ids], (
            f"rank {r}: the {set_name} setter mapped draft layer ids {ids} to capture "
            f"indices {res['layers_to_capture']}, not {[j + 1 for j in ids]}"
        )
        slots = _slots(res, ref["final"].shape[-1])
        for k, index in enumerate(res["layers_to_capture"]):
            if index < L and k < len(slots):
                _close(fam, slots[k], ref["hidden_states"][index],
                       f"capture {k} (index {index}, the stream entering layer {index})", r)


@pytest.mark.parametrize("name, tp, set_name, fusion", list(_params("last")))
def test_last_layer_capture(rank_pool, references, name, tp, set_name, fusion):
    fam = families()[name]
    ref = references[name]["ref"]
    L = ref["num_layers"]
    ids = _ids(set_name, L)
    post_norm = capture_request(set_name, L).get("final_layer_capture") == "post_norm"
    want, what = ((ref["hidden_states"][L], "post_norm: the final norm's output") if post_norm
                  else (ref["pre_norm"], "pre_norm: the stream entering the final norm"))
    for r, res in enumerate(_results(rank_pool, references, name, tp, set_name, fusion)):
        slots = _slots(res, ref["final"].shape[-1])
        assert res["num_aux"] == len(ids) and len(slots) == len(ids), (
            f"rank {r}: captured {res['num_aux']} of {len(ids)} aux hidden states "
            f"({len(slots)} reached the logits processor's output)"
        )
        k = len(ids) - 1  # the last requested id is layer L - 1: capture index L
        _close(fam, slots[k], want, f"capture {k} (index {L}, {what})", r)


def _expected_captures(ref, forward: dict, set_name: str) -> list:
    """transformers' value of each capture the set requests, in order, at ``forward``'s
    rows (``ref["modes"][mode]`` or the extend's ``ref``)."""
    L = ref["num_layers"]
    post_norm = capture_request(set_name, L).get("final_layer_capture") == "post_norm"
    last = forward["hidden_states"][L] if post_norm else forward["pre_norm"]
    return [forward["hidden_states"][j + 1] if j + 1 < L else last for j in _ids(set_name, L)]


@pytest.mark.parametrize("name, tp, set_name, fusion, mode", list(_mode_params()))
def test_mode(rank_pool, references, name, tp, set_name, fusion, mode):
    fam = families()[name]
    ref = references[name]["ref"]
    hidden, vocab = ref["final"].shape[-1], ref["logits"].shape[-1]
    ids = _ids(set_name, ref["num_layers"])
    forward = None if mode == "idle" else ref["modes"][mode]
    want = None if forward is None else _expected_captures(ref, forward, set_name)
    for r, res in enumerate(_mode_results(rank_pool, references, name, tp, set_name, fusion,
                                          mode)):
        tokens = res["final"].shape[0]
        if forward is None:
            shapes = (tuple(res["final"].shape), tuple(res["logits"].shape))
            assert shapes == ((0, hidden), (0, vocab)), (
                f"rank {r}: an idle batch gave final hidden states and logits of shapes "
                f"{shapes}, not {((0, hidden), (0, vocab))}"
            )
        else:
            _close(fam, res["final"], forward["final"], f"{mode}: final hidden states", r)
            _close(fam, res["logits"], forward["logits"], f"{mode}: next-token logits", r)
        shape = None if res["aux"] is None else tuple(res["aux"].shape)
        if forward is None and not _idle_captures(fam):
            # By design (the spec's idle_captures): the model hands on no captures for
            # an idle batch, which DFlash skips (0.5.23's lfm2, lfm2_moe).
            assert res["num_aux"] == 0 and shape is None, (
                f"rank {r}: idle: the model hands on no captures for an idle batch by "
                f"design, yet {res['num_aux']} reached the logits processor ({shape})"
            )
            continue
        assert res["num_aux"] == len(ids) and shape == (tokens, len(ids) * hidden), (
            f"rank {r}: {mode}: captured {res['num_aux']} of {len(ids)} aux hidden states; "
            f"the logits processor handed on {shape}, not {(tokens, len(ids) * hidden)}"
        )
        for k, (slot, expected) in enumerate(zip(_slots(res, hidden), want or ())):
            _close(fam, slot, expected, f"{mode}: capture {k} (index {ids[k] + 1})", r)
