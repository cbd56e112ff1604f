"""upstream-status: probes on synthetic sources, the status matrix over a local index."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import HarnessError
from harness.patchset.layout import layout
from harness.patchset.pypi import pick_wheel, releases_after, version_key
from harness.upstream.probes import PROBES, DictTree, ZipTree
from harness.upstream.status import load_series, render_table, upstream_status

from .fixtures import (
    A2_EDITS,
    A_EDITS,
    AUX,
    B_EDITS,
    C_EDITS,
    COMM,
    DSV2,
    FIXTURE_PROBES,
    LOGITS,
    PIN,
    Index,
    apply_edits,
    make_root,
    pin_files,
    release_files,
)

ALL = A_EDITS + A2_EDITS + B_EDITS + C_EDITS


def verdicts(files: dict[str, str]) -> dict[str, bool | None]:
    t = DictTree(files)
    return {pid: PROBES[pid](t).found for pid in FIXTURE_PROBES}


# ---------------------------------------------------------------- probes


def test_probes_on_pin_are_absent():
    assert verdicts(pin_files()) == {pid: False for pid in FIXTURE_PROBES}


def test_probes_on_fully_patched_sources_are_present():
    assert verdicts(apply_edits(pin_files(), ALL)) == {pid: True for pid in FIXTURE_PROBES}


def test_each_probe_only_sees_its_own_change():
    files = pin_files()
    expected = {pid: False for pid in FIXTURE_PROBES}
    for pid, edits in [("comm-readonly-residual", A_EDITS), ("dsv2-capture-after-allreduce", A2_EDITS),
                       ("aux-packer", B_EDITS), ("dsv2-capture-final-layer", C_EDITS)]:
        files = apply_edits(files, edits)
        expected[pid] = True
        assert verdicts(files) == expected, pid


def test_comm_probe_tolerates_upstream_naming_and_inline_condition():
    files = apply_edits(pin_files(), A_EDITS)
    renamed = dict(files)
    renamed[COMM] = files[COMM].replace("_post_attn_residual_is_read_only", "_norm_keeps_residual")
    assert PROBES["comm-readonly-residual"](DictTree(renamed)).found is True
    inline = dict(files)
    inline[COMM] = files[COMM].replace(
        "not self._post_attn_residual_is_read_only(\n                residual\n            )",
        "not (not get_attn_tp_context().input_scattered and "
        "apply_flashinfer_allreduce_fusion(residual.shape[0]))",
    )
    r = PROBES["comm-readonly-residual"](DictTree(inline))
    assert r.found is True and "inline condition" in r.evidence[0]


def test_comm_probe_requires_quant_format_and_conditional_clone():
    files = apply_edits(pin_files(), A_EDITS)
    no_quant = dict(files)
    no_quant[COMM] = files[COMM].replace('        quant_format="",\n    ):', "    ):")
    r = PROBES["comm-readonly-residual"](DictTree(no_quant))
    assert r.found is False and any("does not take quant_format" in e for e in r.evidence)
    # the pin's prepare_attn uses both names, but the clone's condition does not: absent
    assert PROBES["comm-readonly-residual"](DictTree(pin_files())).found is False


def test_comm_probe_successor_and_inconclusive():
    files = pin_files()
    del files[COMM]
    assert PROBES["comm-readonly-residual"](DictTree(files)).found is None
    files["sglang/srt/layers/layer_boundary/stage.py"] = (
        "def _prepare_attention(self, hidden_states, capture=None, quant_format=''):\n"
        "    if capture is not None:\n"
        "        capture(hidden_states, owned=self.entry.keeps_input(hidden_states))\n"
        "    return hidden_states\n"
    )
    r = PROBES["comm-readonly-residual"](DictTree(files))
    assert r.found is True and "successor" in r.evidence[0]


def test_dsv2_probe_accepts_successor_capture_kwarg():
    files = apply_edits(pin_files(), A2_EDITS)
    files[DSV2] = files[DSV2].replace(
        "self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(",
        "self.attn_boundary.prepare(",
    ).replace("captured_last_layer_outputs=captured_last_layer_outputs,",
              "capture_gathered=captured_last_layer_outputs,")
    r = PROBES["dsv2-capture-after-allreduce"](DictTree(files))
    assert r.found is True and "successor" in r.evidence[0]


def test_dsv2_probe_absent_while_loop_still_sums():
    files = apply_edits(pin_files(), A2_EDITS)
    files[DSV2] = files[DSV2].replace(
        "            layer = self.layers[i]\n",
        "            if i in self.layers_to_capture:\n"
        "                aux_hidden_states.append(hidden_states + residual)\n"
        "            layer = self.layers[i]\n",
    )
    r = PROBES["dsv2-capture-after-allreduce"](DictTree(files))
    assert r.found is False and "still builds" in " ".join(r.evidence)


def test_aux_probe_wording_variants():
    files = apply_edits(pin_files(), A_EDITS + A2_EDITS + B_EDITS)
    upstream = release_files()["0.5.17"]  # no copies_on_append; capture(owned=) + copy_
    r = PROBES["aux-packer"](DictTree(upstream))
    assert r.found is True and "copy_" in r.evidence[0]
    # packer but the logits processor only handles a list: absent
    files[LOGITS] = pin_files()[LOGITS]
    r = PROBES["aux-packer"](DictTree(files))
    assert r.found is False and "only handles a list" in r.evidence[-1]
    # module without finalize: absent
    files[AUX] = "class AuxHiddenStatePacker:\n    copies_on_append = True\n"
    assert PROBES["aux-packer"](DictTree(files)).found is False


def test_final_layer_probe_flag_variant_and_placement():
    files = apply_edits(pin_files(), ALL)
    flag = dict(files)
    flag[DSV2] = files[DSV2].replace(
        "        aux_hidden_states = AuxHiddenStatePacker(",
        "        capture_final = self.end_layer in self.layers_to_capture\n"
        "        aux_hidden_states = AuxHiddenStatePacker(",
    ).replace("        if self.end_layer in self.layers_to_capture:\n", "        if capture_final:\n")
    r = PROBES["dsv2-capture-final-layer"](DictTree(flag))
    assert r.found is True and "capture_final" in r.evidence[0]
    # captured after the final norm: does not count
    late = dict(files)
    late[DSV2] = apply_edits(pin_files(), A_EDITS + A2_EDITS + B_EDITS)[DSV2].replace(
        "        if len(aux_hidden_states) == 0:\n",
        "        if self.end_layer in self.layers_to_capture:\n"
        "            aux_hidden_states.append(hidden_states)\n"
        "        if len(aux_hidden_states) == 0:\n",
    )
    assert PROBES["dsv2-capture-final-layer"](DictTree(late)).found is False
    # the in-loop `i in layers_to_capture` check is not a final-layer capture
    assert PROBES["dsv2-capture-final-layer"](DictTree(pin_files())).found is False


def test_probe_reads_wheel_zip(tmp_path: Path):
    from .fixtures import make_wheel

    w = tmp_path / "x.whl"
    make_wheel(w, "9.9", apply_edits(pin_files(), ALL))
    t = ZipTree(w)
    try:
        assert all(PROBES[pid](t).found for pid in FIXTURE_PROBES)
    finally:
        t.close()


# ---------------------------------------------------------------- versions / index


def test_version_order():
    vs = ["0.5.14", "0.5.13.post1", "0.5.2", "0.5.15rc1", "0.5.15", "0.5.10.dev1", "0.5.10", "0.5.15.post1"]
    assert sorted(vs, key=version_key) == [
        "0.5.2", "0.5.10.dev1", "0.5.10", "0.5.13.post1", "0.5.14", "0.5.15rc1", "0.5.15", "0.5.15.post1",
    ]


def test_releases_after_skips_prereleases_and_prefers_cp311():
    files = []
    for v in ["0.5.13.post1", "0.5.14", "0.5.16rc1", "0.5.15"]:
        for tag in ("cp312-cp312-manylinux_2_34_x86_64", "cp311-cp311-manylinux_2_34_aarch64",
                    "cp311-cp311-manylinux_2_34_x86_64"):
            files.append({"filename": f"sglang-{v}-{tag}.whl", "url": "x", "hashes": {"sha256": "0" * 64}})
    index = {"files": files}
    assert releases_after(index, PIN) == ["0.5.14", "0.5.15"]
    assert pick_wheel(index, "0.5.14")["filename"].endswith("cp311-cp311-manylinux_2_34_x86_64.whl")


# ---------------------------------------------------------------- end to end (local index)


@pytest.fixture
def fixture_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "repo"
    root.mkdir()
    served = tmp_path / "served"
    src = make_root(root)
    wheels = {}
    for v, w in src.items():
        dest = served / w.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(w.read_bytes())
        wheels[v] = dest
        if v != PIN:
            w.unlink()  # later releases must come through the index
    monkeypatch.setenv("HARNESS_ROOT", str(root))
    monkeypatch.setenv("HARNESS_NET_TIMEOUT", "5")
    monkeypatch.delenv("HARNESS_CACHE", raising=False)
    with Index(wheels) as idx:
        monkeypatch.setenv("HARNESS_INDEX_URL", idx.url)
        yield root, idx


def test_series_metadata_parsed(fixture_root):
    root, _ = fixture_root
    patches = load_series(layout(root))
    assert [p.id for p in patches] == [
        "comm-readonly-residual", "dsv2-capture-after-allreduce", "aux-packer", "dsv2-capture-final-layer"]
    assert patches[0].probes == ["comm-readonly-residual"]
    assert patches[2].drop_in == "0.5.17" and patches[3].drop_in == "none"
    assert patches[1].files == ["python/sglang/srt/models/deepseek_v2.py"]


def test_status_matrix(fixture_root, tmp_path: Path, capsys):
    root, idx = fixture_root
    from harness.cli import main

    out_json = tmp_path / "status.json"
    assert main(["upstream-status", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    assert [r["version"] for r in report["releases"]] == ["0.5.14", "0.5.15", "0.5.17"]
    st = {p["id"]: {v: c["status"] for v, c in p["releases"].items()} for p in report["patches"]}
    assert st["comm-readonly-residual"] == {"0.5.14": "landed", "0.5.15": "landed", "0.5.17": "landed"}
    assert st["dsv2-capture-after-allreduce"] == {"0.5.14": "landed", "0.5.15": "landed", "0.5.17": "landed"}
    assert st["aux-packer"] == {"0.5.14": "applies", "0.5.15": "applies", "0.5.17": "landed"}
    assert st["dsv2-capture-final-layer"] == {"0.5.14": "applies", "0.5.15": "applies", "0.5.17": "conflicts"}
    by_id = {p["id"]: p for p in report["patches"]}
    assert by_id["comm-readonly-residual"]["first_landed"] == "0.5.14"
    assert by_id["aux-packer"]["first_landed"] == "0.5.17"
    assert all(p["drop_in_agrees"] is True for p in report["patches"])
    # offsets are fine on later releases (0.5.15 adds lines above every hunk)
    assert by_id["aux-packer"]["releases"]["0.5.15"]["apply"]["offsets"]
    # conflicts name the file and the hunk
    probs = by_id["dsv2-capture-final-layer"]["releases"]["0.5.17"]["apply"]["problems"]
    assert probs and probs[0].startswith("python/sglang/srt/models/deepseek_v2.py: hunk #1 @@")
    # landed comes from the probe, with its evidence
    cell = by_id["comm-readonly-residual"]["releases"]["0.5.14"]
    assert cell["apply"] is None and cell["probe"][0]["found"] is True
    assert "_residual_survives_norm" in cell["probe"][0]["evidence"][0]
    assert cell["tests"] == "not run"
    out = capsys.readouterr().out
    assert "first landed" in out and "CONFLICT" in out
    # sha256 verified downloads are cached; a second run needs no wheel download
    n_before = sum(1 for r in idx.requests if r.endswith(".whl"))
    assert main(["upstream-status", "--versions", "0.5.14"]) == 0
    assert sum(1 for r in idx.requests if r.endswith(".whl")) == n_before


def test_drop_in_disagreement_and_strict(fixture_root, tmp_path: Path):
    root, _ = fixture_root
    p = next((root / "patches").glob("0003-*.patch"))
    p.write_text(p.read_text().replace("Drop-In: 0.5.17", "Drop-In: 0.5.15"))
    from harness.cli import main

    out_json = tmp_path / "s.json"
    assert main(["upstream-status", "--strict", "--json", str(out_json)]) == 1
    rep = json.loads(out_json.read_text())
    aux = next(x for x in rep["patches"] if x["id"] == "aux-packer")
    assert aux["drop_in_agrees"] is False and aux["first_landed"] == "0.5.17"


def test_patch_without_probe_never_landed(fixture_root):
    root, _ = fixture_root
    for p in (root / "patches").glob("0001-*.patch"):
        p.write_text(p.read_text().replace("Upstream-Probe: comm-readonly-residual\n", ""))
    rep = upstream_status(layout(root), ["0.5.14"])
    cell = rep["patches"][0]["releases"]["0.5.14"]
    assert cell["status"] == "conflicts"
    assert any("no Upstream-Probe" in n for n in cell["notes"])


def test_sha256_mismatch_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "repo"
    root.mkdir()
    wheels = make_root(root, [PIN, "0.5.14"])
    served = {v: w for v, w in wheels.items()}
    (root / ".cache" / "pypi" / "moved.whl").write_bytes(b"")
    target = tmp_path / wheels["0.5.14"].name
    target.write_bytes(wheels["0.5.14"].read_bytes())
    wheels["0.5.14"].unlink()
    served["0.5.14"] = target
    monkeypatch.setenv("HARNESS_ROOT", str(root))
    with Index(served, sha_override={"0.5.14": "f" * 64}) as idx:
        monkeypatch.setenv("HARNESS_INDEX_URL", idx.url)
        with pytest.raises(HarnessError, match="sha256 mismatch"):
            upstream_status(layout(root), ["0.5.14"])
    assert not (root / ".cache" / "pypi" / target.name).exists()


def test_unknown_version_and_empty_series(fixture_root):
    root, _ = fixture_root
    with pytest.raises(HarnessError, match="9.9.9: not on"):
        upstream_status(layout(root), ["9.9.9"])
    (root / "patches" / "series").write_text("# nothing\n")
    with pytest.raises(HarnessError, match="no patches"):
        upstream_status(layout(root))


def test_render_table_smoke(fixture_root):
    root, _ = fixture_root
    rep = upstream_status(layout(root), ["0.5.14"])
    text = render_table(rep)
    assert "comm-readonly-residual" in text and "LANDED" in text and "applies" in text


# ---------------------------------------------------------------- online (real PyPI wheels)

REAL = Path(__file__).resolve().parents[2] / ".cache" / "pypi"


def _real_wheel(v: str) -> Path | None:
    hits = sorted(REAL.glob(f"sglang-{v}-cp3*-manylinux*x86_64.whl"))
    return hits[0] if hits else None


@pytest.mark.skipif(
    not all(_real_wheel(v) for v in ("0.5.13.post1", "0.5.14", "0.5.16", "0.5.17", "0.5.23"))
    and not os.environ.get("HARNESS_ONLINE"),
    reason="real SGLang wheels not cached in .cache/pypi (run `make upstream-status` once, "
    "or set HARNESS_ONLINE=1 with network)",
)
def test_probes_on_real_releases():
    """The brief's measured facts, on the real PyPI wheels."""
    expect = {
        "0.5.13.post1": dict.fromkeys(PROBES, False),
        "0.5.14": {"comm-readonly-residual": True, "dsv2-capture-after-allreduce": True,
                   "aux-packer": False, "dsv2-capture-final-layer": False},
        "0.5.16": {"comm-readonly-residual": True, "dsv2-capture-after-allreduce": True,
                   "aux-packer": False, "dsv2-capture-final-layer": False},
        "0.5.17": {"comm-readonly-residual": True, "dsv2-capture-after-allreduce": True,
                   "aux-packer": True, "dsv2-capture-final-layer": False},
        "0.5.23": {"comm-readonly-residual": True, "dsv2-capture-after-allreduce": True,
                   "aux-packer": True, "dsv2-capture-final-layer": False},
    }
    # capture-gather-scattered: absent while LayerCommunicator exists, undecidable after
    # upstream replaced it (0.5.21+)
    for v, d in {"0.5.13.post1": False, "0.5.14": False, "0.5.16": False, "0.5.17": False,
                 "0.5.23": None}.items():
        expect.setdefault(v, {})["capture-gather-scattered"] = d
    for v, exp in expect.items():
        w = _real_wheel(v)
        if w is None:  # online mode: fetch through the index into the cache
            from harness.patchset.pypi import fetch_index
            from harness.upstream.status import fetch_release_wheel

            lay = layout(REAL.parents[1])
            idx = fetch_index(lay)
            w = fetch_release_wheel(lay, idx, pick_wheel(idx, v))
        t = ZipTree(w)
        try:
            got = {pid: fn(t).found for pid, fn in PROBES.items()}
        finally:
            t.close()
        assert got == exp, v


_COMM_D = """
class LayerCommunicator:
    def prepare_attn(self, hidden_states, residual, forward_batch, quant_format=""):
        if get_attn_tp_context().input_scattered:
            hidden_states, residual = self._tp_reduce_scatter(hidden_states, residual)
        return hidden_states, residual

    def prepare_attn_and_capture_last_layer_outputs(self, h, r, fb, captured_last_layer_outputs=None, quant_format=""):
        h, r = self.prepare_attn(h, r, fb, quant_format=quant_format)
        if captured_last_layer_outputs is not None:
            out = %s
            captured_last_layer_outputs.append(out)
        return h, r
%s
"""
_GATHER = """
    def _gather_last_layer_output(self, residual, fb):
        if get_attn_tp_context().input_scattered:
            out = residual.new_empty((fb.input_ids.shape[0], residual.shape[-1]))
            get_tp_group().all_gather_into_tensor(out, residual)
            return out
        return residual
"""


def test_gather_scattered_probe():
    probe = PROBES["capture-gather-scattered"]
    rel = "sglang/srt/layers/communicator.py"
    # prepare_attn's own reduce-scatter on input_scattered does not count
    absent = DictTree({rel: _COMM_D % ("self._communicate_simple_fn(r, fb)", "")})
    assert probe(absent).found is False
    present = DictTree({rel: _COMM_D % ("self._gather_last_layer_output(r, fb)", _GATHER)})
    res = probe(present)
    assert res.found is True and "all_gather_into_tensor" in res.evidence[0]
    # LayerCommunicator rewritten upstream: decided by the regression tests instead
    assert probe(DictTree({rel: "x = 1\n"})).found is None
