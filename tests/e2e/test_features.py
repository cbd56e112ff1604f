"""The return-aux tier (SGLang 0.5.23): what ``--enable-return-aux-hidden-states`` hands a
draft trainer equals what transformers computes (``harness.e2e.features``).

Per configuration (a family, the last layer's side of the final norm, the TP size), one
Engine with the radix cache on and ``chunked_prefill_size = 8``; every returned row is
compared whole (all K slots) with transformers' ``output_hidden_states`` on the request's
own token sequence:

- ``test_prompt_rows``: a batch of prompts of different lengths (one extend forward):
  a row per prompt token, each equal to transformers';
- ``test_generated_rows``: every request's rows of its generated tokens (decode forwards),
  equal to transformers' at their positions;
- ``test_chunked_prompt_every_row``: a prompt prefilled in three chunks gets a row per
  prompt token, each equal to transformers'. Pristine 0.5.23 kept the last chunk's rows
  only (``CHUNKED_ROWS`` guards the series' fix);
- ``test_cached_prefix_rows``: a prompt whose first tokens are in the radix cache gets no
  rows for them (``meta_info["cached_tokens"]`` of them), and its other prompt rows
  equal transformers' at their positions.

The prompt-row tests check prompt rows only and ``test_generated_rows`` the rows of the
generated tokens of every request, so a disagreement in decode forwards
(``features.KNOWN``) is one strict xfail, not four.

Guards: the patches that make the captures of a family's forward hold these values on
0.5.23 (its survey bugs, ``harness.standins.models``: the last layer's capture, a wrong
capture expression, a missing setter), and ``final-layer-capture`` for ``post_norm``
(the server argument it adds); the chunked prompt's rows also
``return-aux-chunked-prefill-rows``. Each patch is guarded by the first configuration of
each path (id convention, TP size, side of the final norm) that needs it, not by every
family (``_engine_guards``): ``make ablation`` then starts 11 Engines per run, not 35.
"""

from __future__ import annotations

import pytest

from harness.e2e import features
from harness.e2e.features import FEATURE_CASES, FeatureCase, compare

pytestmark = [pytest.mark.e2e, pytest.mark.bases("0.5.23")]

# Survey bugs whose patch changes what this tier returns on 0.5.23: C (the last layer's
# capture), X and E (gemma3's capture expression), U (no setter: the engine refuses).
VALUE_BUGS = ("C", "X", "E", "U")
# The series' fix for the rows of every chunk but a chunked prompt's last.
CHUNKED_ROWS = "return-aux-chunked-prefill-rows"


def _family_guards(case: FeatureCase) -> list[str]:
    from harness.standins.models import specs

    spec = specs().get(features.family(case.family).spec)
    patches = set()
    if spec is not None:
        bugs = spec.bugs()
        # R: no DFlash setter (which DSPARK falls back to without a DSpark one)
        wanted = VALUE_BUGS + (("R",) if case.method in ("DFLASH", "DSPARK") else ())
        patches = {spec.patch_for(b) for b in wanted if b in bugs} - {None}
    if case.capture == "post_norm":
        patches.add(features.FINAL_LAYER_CAPTURE)
    if case.deepstack:  # the server argument that patch adds
        patches.add(features.DEEPSTACK_CAPTURE)
    return sorted(patches)


def _path(case: FeatureCase) -> tuple:
    """What a configuration runs beyond its family: the id convention, the TP size, the
    side of the final norm and of the deepstack addition."""
    return case.method, case.tp, case.capture, case.deepstack


def _engine_guards() -> dict[FeatureCase, frozenset[str]]:
    """The patches each configuration guards: a patch is guarded by the first
    configuration (``FEATURE_CASES`` order) of each path (``_path``) that needs it, not
    by every family. A family's own capture hunks are guarded where they are cheap to
    see, each family against transformers in the parity tier (``tests/parity``) and the
    model matrix; here one Engine per path shows that the served value needs the patch.
    Every configuration still checks its values in ``make e2e``; the ones that guard
    nothing are not run by ``make ablation`` (an Engine costs seconds, a crashed one a
    fresh driver)."""
    seen: set[tuple] = set()
    out: dict[FeatureCase, frozenset[str]] = {}
    for case in FEATURE_CASES:
        mine = set()
        for patch in (*_family_guards(case), CHUNKED_ROWS):
            if (patch, *_path(case)) not in seen:
                seen.add((patch, *_path(case)))
                mine.add(patch)
        out[case] = frozenset(mine)
    return out


_ENGINE_GUARDS = _engine_guards()


def _params(rows: str | None = None, extra_guards: tuple[str, ...] = ()):
    """One param per configuration, guarded as ``_engine_guards`` says (of
    ``extra_guards``, only those it gives the configuration), or a strict xfail where
    SGLang is known to disagree with transformers on these rows (``features.KNOWN``)."""
    out = []
    for case in FEATURE_CASES:
        known = features.known_failure(case, rows) if rows else None
        no_cache = features.NO_PREFIX_CACHE.get(case.family) if rows == "cached" else None
        if no_cache:  # a skip guards nothing
            marks = [pytest.mark.skip(reason=f"{case.key}: {no_cache}")]
        elif known:
            marks = [pytest.mark.xfail(strict=True, reason=known)]
        else:
            mine = _ENGINE_GUARDS[case]
            wanted = (mine - {CHUNKED_ROWS}) | (mine & set(extra_guards))
            marks = [pytest.mark.guards(p) for p in sorted(wanted)]
        out.append(pytest.param(case, id=case.key, marks=marks))
    return out


def _run(feature_runs, case: FeatureCase):
    return feature_runs.get(case)


@pytest.mark.parametrize("case", _params("prompt"))
def test_prompt_rows(feature_runs, case):
    run = _run(feature_runs, case)
    for i, req in enumerate(run.stage("mixed")):
        n = len(req.prompt)
        assert req.meta.get("cached_tokens", 0) == 0, f"{case.key} mixed[{i}]: {req.meta}"
        assert req.rows.shape[0] == len(req.sequence), (
            f"{case.key} mixed[{i}]: {req.rows.shape[0]} rows for {n} prompt + "
            f"{len(req.output_ids) - 1} generated tokens")
        want = run.expected(req)
        problem = compare(req.rows[:n], want[:n], run)
        assert problem is None, f"{case.key} mixed[{i}] prompt rows (prompt of {n}): {problem}"


@pytest.mark.parametrize("case", _params("generated"))
def test_generated_rows(feature_runs, case):
    run = _run(feature_runs, case)
    for req in run.requests:
        g = len(req.output_ids) - 1
        assert g == features.MAX_NEW_TOKENS - 1 and req.rows.shape[0] >= g, (
            f"{case.key} {req.stage}: {req.rows.shape[0]} rows, {len(req.output_ids)} tokens generated")
        want = run.expected(req)
        problem = compare(req.rows[-g:], want[-g:], run)
        assert problem is None, f"{case.key} {req.stage} rows of the generated tokens: {problem}"


@pytest.mark.parametrize("case", _params("chunked", (CHUNKED_ROWS,)))
def test_chunked_prompt_every_row(feature_runs, case):
    """A prompt of 19 tokens prefilled in chunks of 8, 8 and 3: a row per prompt token
    (then one per generated token but the last), each equal to transformers'."""
    run = _run(feature_runs, case)
    (req,) = run.stage("chunked")
    n, g = len(req.prompt), len(req.output_ids) - 1
    assert req.rows.shape[0] == n + g, (
        f"{case.key}: {req.rows.shape[0] - g} rows for a prompt of {n} prefilled in chunks of {features.CHUNK}")
    problem = compare(req.rows[:n], run.expected(req)[:n], run)
    assert problem is None, f"{case.key} chunked prompt: {problem}"


@pytest.mark.parametrize("case", _params("cached"))
def test_cached_prefix_rows(feature_runs, case):
    """A prompt sharing its first ``SHARED`` tokens with an earlier request: SGLang
    computes (and returns) no rows for the cached prefix, ``cached_tokens`` says how many;
    the prompt rows it returns equal transformers' at their positions."""
    run = _run(feature_runs, case)
    (req,) = run.stage("cached")
    n, g = len(req.prompt), len(req.output_ids) - 1
    cached = int(req.meta.get("cached_tokens", 0))
    assert cached == features.SHARED, f"{case.key}: cached_tokens {cached}, expected a radix hit of {features.SHARED}"
    assert req.rows.shape[0] == n - cached + g, (
        f"{case.key}: {req.rows.shape[0] - g} prompt rows for a prompt of {n} with {cached} cached; "
        f"expected {n - cached}")
    problem = compare(req.rows[:n - cached], run.expected(req)[cached:n], run)
    assert problem is None, f"{case.key} prompt rows after the cached prefix: {problem}"


def _raw_params():
    """The configurations sent twice (``features.RAW_CASES``); the first guards the patch
    that returns the raw form (without it the Engine refuses the argument: one Engine
    shows it, each refused one costs the ablation a driver)."""
    return [pytest.param(case, id=case.key,
                         marks=[pytest.mark.guards(features.RAW_HIDDEN_STATES)] if i == 0 else [])
            for i, case in enumerate(features.RAW_CASES)]


@pytest.mark.parametrize("case", _raw_params())
def test_raw_rows_equal_list_rows(feature_runs, case):
    """Each request of every stage sent again, from an empty radix cache, asking for one
    tensor per request (``return_raw_hidden_states``): a tensor of the list rows' shape
    in the Engine's dtype, equal to them bit for bit (so every value check of the list
    rows against transformers holds for it), with the same output tokens and, for the
    cached prompt, the same cached prefix."""
    import torch

    run = _run(feature_runs, case)
    for req in run.requests:
        what = f"{case.key} {req.stage}"
        assert not isinstance(req.raw, Exception), f"{what}: the raw form: {req.raw}"
        assert isinstance(req.raw, torch.Tensor) and req.raw.dtype == torch.float32, (
            f"{what}: {type(req.raw).__name__} {getattr(req.raw, 'dtype', '')}")
        assert req.raw_output_ids == req.output_ids, f"{what}: {req.raw_output_ids} != {req.output_ids}"
        assert tuple(req.raw.shape) == tuple(req.rows.shape), (
            f"{what}: raw {tuple(req.raw.shape)}, lists {tuple(req.rows.shape)}")
        assert torch.equal(req.raw, req.rows), (
            f"{what}: raw rows differ from the list rows by {float((req.raw - req.rows).abs().max()):.3g}")
