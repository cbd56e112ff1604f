"""The doctor's inputs: what a draft declares (config keys against safetensors headers),
and the one-line refusals of what it cannot read, before anything starts or is written.

No SGLang here: ``python -m harness doctor`` reads and checks the target, the draft and
the features before it starts its rank (tests/parity/test_doctor.py runs the rest).
"""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.doctor import declared, rules, terms

H = 64


def _write(directory, config, tensors=None):
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(shape) for k, shape in (tensors or {"fc.weight": (H, 3 * H)}).items()},
              str(directory / "model.safetensors"))
    return directory


def _target(tmp_path, **over):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "num_hidden_layers": 6, "torch_dtype": "bfloat16", **over}
    return _write(tmp_path / "target", config, {"lm_head.weight": (8, H)})


def _eagle3(tmp_path, ids=(1, 3, 4), name="draft", tensors=None, **over):
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "target_hidden_size": H,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
              **over}
    return _write(tmp_path / name, config, tensors or {"fc.weight": (H, len(ids) * H)})


def _doctor(tmp_path, capsys, target, draft, *extra):
    out = tmp_path / "report.json"
    code = main(["doctor", "--target", str(target), "--draft", str(draft), "--json", str(out), *extra])
    err = capsys.readouterr().err.strip()
    return code, err, out


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("what", ["unknown-family", "bad-json", "no-algorithm", "not-on-base",
                                  "no-layers", "bad-ids"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, what):
    target, draft = _target(tmp_path), _eagle3(tmp_path)
    expect = {
        "unknown-family": "unknown family: architectures ['FooForCausalLM']",
        "bad-json": "cannot read it",
        "no-algorithm": "cannot tell its algorithm",
        "not-on-base": "is not served on SGLang 0.5.13.post1",
        "no-layers": "no num_hidden_layers / hidden_size",
        "bad-ids": "is not a list of layer ids",
    }[what]
    if what == "unknown-family":
        target = _target(tmp_path, architectures=["FooForCausalLM"])
    elif what == "bad-json":
        (target / "config.json").write_text("{not json")
    elif what == "no-algorithm":
        (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    elif what == "not-on-base":
        target = _target(tmp_path, architectures=["LagunaForCausalLM"], model_type="laguna")
    elif what == "no-layers":
        config = json.loads((target / "config.json").read_text())
        del config["num_hidden_layers"]
        (target / "config.json").write_text(json.dumps(config))
    elif what == "bad-ids":
        draft = _eagle3(tmp_path, name="draft2", tensors={"fc.weight": (H, 3 * H)})
        config = json.loads((draft / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = "1,3,4"
        (draft / "config.json").write_text(json.dumps(config))
    code, err, out = _doctor(tmp_path, capsys, target, draft)
    assert code == 1
    assert err.startswith("error: doctor: ") and expect in err, err
    assert "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("what", ["missing-key", "rows", "width", "not-a-dict", "unreadable"])
def test_bad_features_are_one_line(tmp_path, capsys, what):
    import torch

    target, draft = _target(tmp_path), _eagle3(tmp_path)
    data = {"input_ids": torch.arange(5), "aux_hidden_state": torch.zeros(1, 5, 3 * H)}
    expect = {"missing-key": "no aux_hidden_state", "rows": "has 4 rows for 5 input_ids",
              "width": "not a multiple of the target's hidden size 64", "not-a-dict": "not a dict of tensors",
              "unreadable": "cannot read it"}[what]
    path = tmp_path / "features.pt"
    if what == "missing-key":
        del data["aux_hidden_state"]
    elif what == "rows":
        data["aux_hidden_state"] = torch.zeros(4, 3 * H)
    elif what == "width":
        data["aux_hidden_state"] = torch.zeros(5, 3 * H + 1)
    elif what == "not-a-dict":
        data = [data]
    if what == "unreadable":
        path.write_bytes(b"not a torch file")
    else:
        torch.save(data, str(path))
    code, err, out = _doctor(tmp_path, capsys, target, draft, "--features", str(path))
    assert code == 1 and expect in err and str(path) in err and "\n" not in err, err
    assert not out.exists()


# ------------------------------------------------------------------ what a draft declares


def test_consistent_draft_has_no_findings(tmp_path):
    decl = declared.read(_eagle3(tmp_path))
    declared.check_against_target(decl, H, 6)
    assert decl.method == "EAGLE3" and decl.ids == [1, 3, 4]
    assert decl.ids_key == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert decl.findings == []


def test_fc_width_against_id_count(tmp_path):
    decl = declared.read(_eagle3(tmp_path, ids=(1, 3), tensors={"fc.weight": (H, 3 * H)}))
    assert [f.severity for f in decl.findings] == ["error"]
    assert "fc.weight reads 192 features, but the config gives 2 ids" in decl.findings[0].what
    assert "trained on 3 captures" in decl.findings[0].what


def test_fc_width_against_the_target_without_target_hidden_size(tmp_path):
    draft = _eagle3(tmp_path, tensors={"fc.weight": (H, 3 * 2 * H)})
    config = json.loads((draft / "config.json").read_text())
    del config["target_hidden_size"]
    (draft / "config.json").write_text(json.dumps(config))
    decl = declared.read(draft)
    assert decl.findings == []
    declared.check_against_target(decl, H, 6)
    assert any("the target's hidden size 64" in f.what for f in decl.findings)


def test_top_level_ids_are_not_read_by_sglang(tmp_path):
    draft = _write(tmp_path / "spec", {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                                       "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "target_hidden_size": H})
    decl = declared.read(draft)
    assert decl.method == "EAGLE3" and decl.ids is None
    assert decl.all_ids == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert any(f.severity == "error" and "top level" in f.what and "vllm#50170" in f.what for f in decl.findings)


def test_conflicting_id_keys(tmp_path):
    decl = declared.read(_eagle3(tmp_path, eagle_aux_hidden_state_layer_ids=[0, 2, 3]))
    assert decl.ids == [1, 3, 4]
    assert any("different ids in different keys" in f.what for f in decl.findings)


@pytest.mark.parametrize("base, fix", [("0.5.13.post1", "serve the draft on SGLang 0.5.23"),
                                       ("0.5.23", 'set "norm_before_fc": true')])
def test_norm_tensor_no_key_turns_on(tmp_path, base, fix):
    decl = declared.read(_eagle3(tmp_path, tensors={"fc.weight": (H, 3 * H), "input_norm.weight": (3 * H,)}),
                         base=base)
    (f,) = decl.findings
    assert f.severity == "error" and "input_norm.weight" in f.what and "no key turns it on" in f.what
    assert f.fix.startswith(fix), f.fix


def test_norm_keys_without_tensors(tmp_path):
    decl = declared.read(_eagle3(tmp_path, norm_before_fc=True, fc_norm=True))
    whats = " | ".join(f.what for f in decl.findings)
    assert "norm_before_fc is true, but the draft holds no input_norm" in whats
    assert "fc_norm is true, but the draft holds no fc_norm" in whats


def test_fc_norm_tensors_without_key(tmp_path):
    tensors = {"fc.weight": (H, 3 * H), **{f"fc_norm.{i}.weight": (H,) for i in range(3)}}
    decl = declared.read(_eagle3(tmp_path, tensors=tensors))
    assert any("fc_norm.0.weight" in f.what and "no key" in f.what for f in decl.findings)


def test_dflash_draft_ids_and_settings(tmp_path):
    draft = _write(tmp_path / "dflash", {"architectures": ["DFlashDraftModel"], "target_layer_ids": [0, 1],
                                         "dflash_config": {"target_layer_ids": [1, 3, 5],
                                                           "final_layer_capture": "post_norm"}})
    decl = declared.read(draft)
    assert decl.method == "DFLASH" and decl.ids == [1, 3, 5] and decl.ids_key == "dflash_config.target_layer_ids"
    assert decl.settings == {"final_layer_capture": "post_norm"}
    assert decl.settings_key("final_layer_capture") == "dflash_config.final_layer_capture"


def test_ids_out_of_the_targets_range(tmp_path):
    decl = declared.read(_eagle3(tmp_path, ids=(1, 3, 6)))
    declared.check_against_target(decl, H, 6)
    assert any("[6] outside the target's layers 0..5" in f.what for f in decl.findings)


# ------------------------------------------------------------------ rules and terms


def test_pristine_and_vllm_readings():
    # SGLang adds 1 to explicit EAGLE3 ids; the pin never captures the last layer.
    assert rules.pristine("0.5.13.post1", "llama", "EAGLE3", [1, 3, 5], 6, "llama.py") == [
        "hidden_states[2]", "hidden_states[4]", "missing: the pin never captures the last layer (K-1 of K)"]
    # deepseek_v2 adds 1 only when the first id is 1 (sgl-project/sglang#25454).
    assert rules.pristine("0.5.23", "deepseek_v3", "EAGLE3", [0, 2, 4], 6, "deepseek_v2.py")[:2] == [
        "hidden_states[0]", "hidden_states[2]"]
    assert rules.pristine("0.5.23", "gpt_oss", "EAGLE3", [1, 5], 6, "gpt_oss.py") == ["hidden_states[2]", "pre_norm"]
    assert rules.pristine("0.5.23", "gemma3", "EAGLE3", [1], 6, "gemma3_causal.py") == ["branch[2]"]
    assert rules.pristine("0.5.23", "qwen3_vl", "EAGLE3", [0, 3], 6, "qwen3_vl.py") == [
        "hidden_states[1]+deepstack[0]", "hidden_states[4]"]
    assert rules.pristine("0.5.13.post1", "qwen3_vl", "EAGLE3", [0], 6, "qwen3_vl.py") == ["hidden_states[1]"]
    # vLLM: id k is hidden_states[k], the last layer's output pre_norm; DFlash ids + 1.
    assert rules.vllm("EAGLE3", [0, 3, 6], 6) == ["hidden_states[0]", "hidden_states[3]", "pre_norm"]
    assert rules.vllm("DFLASH", [1, 5], 6) == ["hidden_states[2]", "pre_norm"]
    assert rules.vllm("EAGLE3", None, 8) == ["hidden_states[2]", "hidden_states[4]", "hidden_states[5]"]
    for row in rules.table("0.5.23"):
        assert row["source"] and row["feeds"]


def test_terms_round_trip_and_words():
    for term in (terms.Term(0, "hs"), terms.Term(6, "hs"), terms.Term(6, "pre_norm"),
                 terms.Term(2, "post_deepstack"), terms.Term(3, "branch")):
        assert terms.parse(term.key(), 6) == term
    assert "post_norm" in terms.Term(6, "hs").describe(6)
    assert "pre_norm" in terms.Term(6, "pre_norm").describe(6)
    assert "embeddings" in terms.Term(0, "hs").describe(6)


def test_match_is_relative_and_names_the_runner_up():
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, H, generator=g), torch.randn(5, H, generator=g)
    found = {terms.Term(1, "hs"): a, terms.Term(2, "hs"): b}
    m = terms.match(a * 1.001, found)
    assert m.term == terms.Term(1, "hs") and m.error < 2e-3 and m.runner_up == terms.Term(2, "hs")
    assert not m.ambiguous
    far = terms.match(a + b, found)
    assert far.term is None and far.best in found
