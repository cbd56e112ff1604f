"""Every capturing model of the active base at TP = 1, in this worker (docs/MODELS.md).

- it returns its captures packed into one ``[tokens, K * hidden]`` tensor
  (the pin's models-aux-packer; 0.5.23's series leaves list-collecting models alone);
- an idle batch (zero tokens) still gives K of K, including the last layer
  (models-capture-final-layer);
- its real ``XModel.forward`` traces with ``torch.compile(fullgraph=True)`` (what
  SGLang's piecewise CUDA graph does on CUDA; ``backend="eager"`` here) with in-loop
  and last-layer captures, the last one taken on either side of the final norm
  (``pre_norm``; ``post_norm`` for every model at the pin, four on 0.5.23), and the
  compiled forward gives the eager result. Where the
  base itself cannot trace fullgraph (0.5.23's layer boundaries with torch 2.14:
  ``harness.standins.v0_5_23.models``), the forward compiles with graph
  breaks, every break is one of the base's own, and it still gives the eager result.
"""

from __future__ import annotations

import pytest
import torch

from harness.standins.models import specs
from harness.suites.models import capture_case, layer_sets

pytestmark = pytest.mark.bases("0.5.13.post1", "0.5.23")

NAMES = sorted(specs())


def _guarded(bug: str):
    """One param per model; the ones with ``bug`` guard the active base's fix for it, or
    are skipped where its series leaves the bug alone."""
    out = []
    for n in NAMES:
        spec = specs()[n]
        marks = []
        if bug in spec.bugs():
            patch = spec.patch_for(bug)
            marks = [pytest.mark.guards(patch)] if patch else [
                pytest.mark.skip(reason=f"bug {bug!r} is not fixed by this base's series (docs/MODELS.md)")]
        out.append(pytest.param(n, marks=marks))
    return out


@pytest.mark.parametrize("name", _guarded("B"))
def test_returns_packed_captures(sglang_tp1, name):
    spec = specs()[name]
    res = capture_case(0, 1, model=name, layers_to_capture=layer_sets(spec.tiny.num_layers)["eagle3-default"])
    assert res["returned_packed"], f"{name} returned its captures as a list, not one packed tensor"
    assert res["captures"].shape == res["expected"].shape
    assert torch.equal(res["captures"], res["expected"])


@pytest.mark.parametrize("name", _guarded("C"))
def test_idle_batch_captures_k_of_k(sglang_tp1, name):
    spec = specs()[name]
    layers = layer_sets(spec.tiny.num_layers)["eagle3-last"]
    res = capture_case(0, 1, model=name, layers_to_capture=layers, num_tokens=0, mode="idle")
    if not spec.idle_captures:
        # By design: the forward returns the bare hidden states on an idle batch.
        assert res["captures"] is None, f"{name}: captures on an idle batch"
        return
    assert res["num_captured"] == len(layers), (
        f"{name}: captured {res['num_captured']} of {len(layers)} on an idle batch"
    )
    assert tuple(res["captures"].shape) == (0, len(layers) * spec.tiny.hidden_size)


# A trace takes 6-10 s on 0.5.23 (torch 2.14), 2-3 s at the pin. There the post_norm
# trace runs for one model per shape of the last capture, not for all: the plain norm
# (llama), residual_batch.final_norm without and with skip_empty (deepseek_v2,
# qwen2_moe), a norm without residual (gemma3). Every model's post_norm forward runs
# eagerly in the model matrix.
POST_NORM_TRACES = {"0.5.23": ("llama", "deepseek_v2", "qwen2_moe", "gemma3")}


def _trace_params():
    from harness.patchset.layout import layout

    only = POST_NORM_TRACES.get(layout().label)
    for n in NAMES:
        yield pytest.param(n, "pre_norm", id=f"{n}-pre_norm")
        if (only is None or n in only) and specs()[n].post_norm:
            yield pytest.param(n, "post_norm", id=f"{n}-post_norm",
                               marks=pytest.mark.guards("final-layer-capture"))


@pytest.mark.parametrize("name, final_layer_capture", list(_trace_params()))
def test_forward_traces_fullgraph(sglang_tp1, name, final_layer_capture):
    from harness.standins import bases
    from harness.suites.models import compiled_matches_eager

    layers = layer_sets(specs()[name].tiny.num_layers)["eagle3-last"]
    base_models = bases.module("models")
    allowed = None
    if base_models is not None and name not in base_models.TRACES_FULLGRAPH:
        allowed = base_models.GRAPH_BREAKS
    eager, compiled, breaks = compiled_matches_eager(name, layers, fullgraph=allowed is None,
                                                     final_layer_capture=final_layer_capture)
    if allowed is not None:
        assert breaks, f"{name}: now traces without graph breaks; add it to TRACES_FULLGRAPH"
        foreign = [b for b in breaks if not any(a in b for a in allowed)]
        assert not foreign, f"{name}: graph breaks that are not the base's own: {foreign}"
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c), f"{name}: compiled forward differs from eager"


@pytest.mark.bases("0.5.13.post1")
@pytest.mark.guards("deepstack-capture-setting")
@pytest.mark.parametrize("setting", ["pre_deepstack", "post_deepstack"])
@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_vl_moe"])
def test_deepstack_forward_traces_fullgraph(sglang_tp1, name, setting):
    """The Qwen3-VL forwards with deepstack embeddings on every token, captures on
    either side of them (the pin's deepstack-capture-setting; 0.5.23's layer boundaries
    do not trace fullgraph at all, see harness/standins/v0_5_23/models)."""
    from harness.standins.kernels import device, model_dtype
    from harness.suites.models import compiled_matches_eager, get_model

    spec = specs()[name]
    layers = layer_sets(spec.tiny.num_layers)["eagle3-last"]
    model = get_model(name)
    model.set_deepstack_capture(setting)
    g = torch.Generator().manual_seed(17)
    deepstack = torch.randint(-2, 3, (6, 3 * spec.tiny.hidden_size), generator=g).to(
        device=device(), dtype=model_dtype(spec.tiny))
    try:
        eager, compiled, _ = compiled_matches_eager(name, layers,
                                                    input_deepstack_embeds=deepstack)
    finally:
        model.set_deepstack_capture("pre_deepstack")
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c), f"{name}: compiled forward differs from eager"
