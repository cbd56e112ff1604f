"""Qwen3-VL (dense and MoE) in SGLang's real speculative Engine, with an image: the
draft config's ``deepstack_capture`` reaches the model through the model runner, and
every capture the target hands its EAGLE3 draft equals transformers' (0.5.23).

Per family, the return-aux tier's Qwen3-VL checkpoint (``harness.e2e.features``: a tower
whose three blocks feed deepstack into decoder layers 0-2, a tiny processor beside it)
and a random EAGLE3 draft (M-RoPE positions, as a Qwen3-VL draft has) whose
``eagle_config`` names ids ``[1, 2, 3]`` (captures 2, 3 and the last layer's: the first
two next to a deepstack addition) and ``deepstack_capture: pre_deepstack``, which is not
0.5.23's default (``post_deepstack``). One prompt with a 16 x 16 image, greedy, through a
plain Engine and the speculative one (the probe on, ``harness.e2e.probe``):

- ``test_spec_equals_plain``: the speculative output equals the plain output;
- ``test_draft_config_deepstack_reaches_the_model``: the model runner handed the model
  the draft config's value (``set_deepstack_capture``) and nothing else;
- ``test_captures_equal_transformers``: every target forward's captures (the extend and
  every verify, rejected drafts included), all three slots, against transformers on
  the tokens each row was computed on, with the image's pixel values: the captures next
  to the deepstack addition hold ``hidden_states[k]``, the layer's output before it.
  Under the default they would hold the stream entering the next layer (11 apart on
  the image's rows in the return-aux tier), so a setting lost on its way fails here.

Guards ``qwen3-vl-deepstack-capture`` (the patch that reads the key).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.bases("0.5.23")]

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
IDS = (1, 2, 3)
DEEPSTACK = "pre_deepstack"
MAX_NEW_TOKENS = 8
GUARD = pytest.mark.guards("qwen3-vl-deepstack-capture")
MROPE_SECTION = [2, 3, 3]  # the parity family's (harness/parity/families/qwen3_vl.py)


@pytest.fixture(scope="module")
def vl_runs(e2e_runs, tmp_path_factory):
    """Per family: the checkpoint, the prompt and its transformers inputs, the plain and
    speculative outputs and the speculative Engine's probe events (or the Engine's error)."""
    from harness.e2e import checkpoints, features, multimodal, probe
    from harness.e2e.engine import EngineConfig, EngineError

    session = e2e_runs.session
    root = tmp_path_factory.mktemp("vl")
    out = {}
    for family in FAMILIES:
        ckpt = features.make_checkpoint(family, root / family)
        draft = checkpoints.make_eagle3(root / f"{family}-draft", list(IDS), exact=False, vocab=160,
                                        deepstack_capture=DEEPSTACK, mrope_section=MROPE_SECTION)
        prompt = [10, 11, 12, 13, *multimodal.placeholder(family), 14, 15]
        sampling = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
        record = root / f"{family}.probe.jsonl"
        run = {"ckpt": ckpt, "prompt": prompt, "inputs": multimodal.hf_inputs(ckpt.path, prompt, ckpt.image)}
        try:
            for name, algorithm in (("plain", None), ("spec", "EAGLE3")):
                config = EngineConfig(key=f"{family}-vl-{name}", model=family, target=str(ckpt.path),
                                      draft=str(draft) if algorithm else None, algorithm=algorithm,
                                      extra=(("skip_tokenizer_init", True),))
                session.ensure(config, probe=record if algorithm else None)
                (got,) = session.generate(None, sampling, input_ids=[prompt], image_data=[str(ckpt.image)])
                run[name] = got
            run["events"] = probe.read(str(record))
        except EngineError as exc:
            run["error"] = exc
        out[family] = run
    return out


def _run(vl_runs, family):
    run = vl_runs[family]
    if "error" in run:
        raise run["error"]
    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_equals_plain(vl_runs, family):
    run = _run(vl_runs, family)
    assert run["spec"]["output_ids"] == run["plain"]["output_ids"], (
        f"{family}: speculative {run['spec']['output_ids']} != plain {run['plain']['output_ids']}")
    assert int(run["spec"]["meta"].get("spec_verify_ct", 0)) >= 2, run["spec"]["meta"]


@GUARD
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_config_deepstack_reaches_the_model(vl_runs, family):
    run = _run(vl_runs, family)
    got = [(e["model"], e["value"]) for e in run["events"] if e["event"] == "deepstack"]
    assert got and {v for _, v in got} == {DEEPSTACK}, f"{family}: set_deepstack_capture calls {got}"


@GUARD
@pytest.mark.parametrize("family", FAMILIES)
def test_captures_equal_transformers(vl_runs, family):
    import torch

    from harness.e2e import features

    run = _run(vl_runs, family)
    ckpt, inputs = run["ckpt"], run["inputs"]
    prompt = inputs["input_ids"][0].tolist()
    full = prompt + list(run["spec"]["output_ids"])
    fam = features.family(family)
    indices = [j + 1 for j in IDS]
    cache: dict[tuple, torch.Tensor] = {}

    def rows(context: list[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in cache:
            got = features.hf_rows(ckpt.model, context, indices, ckpt.layers, "pre_norm", fam.hf_final_norm,
                                   inputs=inputs)
            for k in range(len(prompt), len(context) + 1):
                cache.setdefault(key[:k], got[k - 1])
            cache[key] = got[-1]
            cache[("all",) + key] = got
        return cache[key]

    events = [e for e in run["events"] if e["event"] == "captures"]
    modes = [e["mode"] for e in events]
    assert modes.count("TARGET_VERIFY") >= 2 and modes[0] == "EXTEND", modes
    problems, checked = [], 0
    slots = features.slot_names(IDS, ckpt.layers)
    for n, ev in enumerate(events):
        got = torch.tensor(ev["rows"], dtype=torch.float32)
        if ev["mode"] == "EXTEND":
            assert len(got) == len(prompt), f"extend: {len(got)} rows for a prompt of {len(prompt)}"
            rows(prompt)
            want = cache[("all",) + tuple(prompt)]
        else:
            # The verify rows: the chain after the tokens the request had committed then
            # (its positions count them: the image's tokens too, M-RoPE aside).
            start = ev["positions"][0]
            paths = ev["ancestors"] or [list(range(r + 1)) for r in range(len(got))]
            contexts = [full[:start] + [ev["input_ids"][a] for a in path] for path in paths]
            for c in sorted(contexts, key=len, reverse=True):  # a chain: one forward for all
                rows(c)
            want = torch.stack([rows(c) for c in contexts])
        problem = features.compare_rows(got, want, ckpt.hidden, slots, fam.atol, fam.rtol)
        checked += len(got)
        if problem:
            problems.append(f"forward {n} ({ev['mode']}): {problem}")
    assert checked and not problems, f"{family}: {len(problems)} forwards differ:\n" + "\n".join(problems[:6])
