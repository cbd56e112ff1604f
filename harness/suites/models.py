"""Aux-capture cases on every capturing model of the pin, runnable in any rank.

The model-matrix counterpart of :mod:`harness.suites.capture` (which drives
``deepseek_v2`` in more depth). For a model spec (:mod:`harness.standins.models`), a
layer set and a fusion mode, :func:`capture_case` runs the real ``XModel.forward`` with
those captures requested through the model's own mechanism and returns plain data.

The reference for capture index ``i`` is the complete output of layer ``i - 1``
(``hidden_states + residual`` after its all-reduce, by the spec's ``layer_output``),
taken with forward hooks on a run with fusion off and nothing captured, so it does
not depend on the capture code under test. Models are built once per rank and reused.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Dict, List, Sequence, Tuple

_MODELS: Dict[str, Any] = {}
_REFS: Dict[Tuple[str, int, str], Any] = {}


def get_model(name: str):
    from harness.standins.models import build, specs

    if name not in _MODELS:
        _MODELS[name] = build(specs()[name])
    return _MODELS[name]


def bare(cls, **attrs):
    """SGLang's real ``cls`` (an ``nn.Module``) created without its __init__, which would
    build its weights, holding only ``attrs``: what the code under test reads (e.g. a
    CausalLM's setters: its model, pipeline group, config and capture flag)."""
    from torch import nn

    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


def num_layers(model) -> int:
    from harness.standins.models import specs

    spec = specs()[model.auxcap_spec]
    return len(getattr(model, spec.layers_attr))


def layer_sets(n: int) -> Dict[str, List[int]]:
    """The layers_to_capture variants, as SGLang's setters compute them."""
    return {
        # set_eagle3_layers_to_capture(None): [2, n // 2, n - 3]
        "eagle3-default": [2, n // 2, n - 3],
        # set_eagle3_layers_to_capture(ids) with the last layer: [id + 1 for id in ids]
        "eagle3-last": [1 + 1, (n // 2) + 1, (n - 1) + 1],
        # set_dflash_layers_to_capture(ids): [id + 1 for id in ids]
        "dflash": [0 + 1, 2 + 1, (n - 2) + 1, (n - 1) + 1],
    }


def input_ids(num_tokens: int, vocab_size: int, seed: int = 7):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (num_tokens,), generator=g)


def _forward(model, ids, mode: str = "extend", tbo: bool = False, **inputs):
    """The spec's real forward on ``ids``; returns (final hidden states, aux or None).

    ``tbo``: the batch can run two-batch overlap (``tbo_split_seq_index`` set, as the
    scheduler's TBO preparer does). ``inputs``: extra forward arguments (e.g.
    ``input_deepstack_embeds``).
    """
    import torch

    from harness.standins.batch import make_forward_batch
    from harness.standins.kernels import device
    from harness.standins.models import specs

    spec = specs()[model.auxcap_spec]
    fb = make_forward_batch(ids.to(device()), mode)
    if tbo:
        fb.tbo_split_seq_index = max(1, ids.shape[0] // 2)
    ids = ids.to(device())
    positions = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)
    with torch.no_grad():
        out = spec.run(model, ids, positions, fb, **inputs)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


def reference(name: str, num_tokens: int, mode: str = "extend"):
    """(complete output of every layer, index i = input of layer i; final hidden states)."""
    from harness.standins.kernels import fusion_mode
    from harness.standins.models import specs

    key = (name, num_tokens, mode)
    if key in _REFS:
        return _REFS[key]
    spec = specs()[name]
    model = get_model(name)
    spec.configure(model, [])
    outputs: List[Any] = []
    handles = [
        layer.register_forward_hook(lambda m, a, o: outputs.append(spec.layer_output(o).clone()))
        for layer in getattr(model, spec.layers_attr)
    ]
    try:
        with fusion_mode("off"):
            final, _ = _forward(model, input_ids(num_tokens, spec.tiny.vocab_size), mode)
    finally:
        for h in handles:
            h.remove()
    # Index 0 (the embeddings) is never requested by these layer sets.
    _REFS[key] = ([None] + outputs, final.clone())
    return _REFS[key]


def as_packed(aux):
    import torch

    if aux is None:
        return None
    if isinstance(aux, torch.Tensor):
        return aux
    return torch.cat(list(aux), dim=-1)


def capture_case(
    rank: int,
    world_size: int,
    *,
    model: str,
    layers_to_capture: Sequence[int],
    fusion: str = "off",
    num_tokens: int = 6,
    mode: str = "extend",
    tbo: bool = False,
    list_only: bool = False,
    final_layer_capture: str = "pre_norm",
) -> Dict[str, Any]:
    """Runs one capture case; returns plain data for cross-rank comparison.

    ``final_layer_capture``: what the last layer's capture holds, set the way the model
    runner sets it (``set_final_layer_capture``, patch final-layer-capture); with
    ``post_norm`` the expected last capture is the final norm's output (the final
    hidden states), and a tree without the setting fails the case.

    ``list_only``: request the captures by setting the model's ``layers_to_capture``
    alone, as the Qwen3-VL wrapper's setter does for its language model, instead of
    through the model's own setter.

    ``tbo``: a batch that can run two-batch overlap; ``model_forward_maybe_tbo`` is
    replaced by a sequential CPU stand-in of the TBO executor (same layers, same math,
    and, like the real operation strategies, no captures), and the number of layers
    the model sent through it is returned as ``tbo_layers``.
    """
    import torch

    from harness.standins.kernels import fusion_mode
    from harness.standins.models import specs

    spec = specs()[model]
    m = get_model(model)
    refs, ref_final = reference(model, num_tokens, mode)
    tbo_layers: List[int] = []
    if list_only:
        m.layers_to_capture = list(layers_to_capture)
    else:
        spec.configure(m, layers_to_capture)
    try:
        with (serving_final_layer_capture(final_layer_capture, m), fusion_mode(fusion),
              _tbo_executor(m, tbo_layers, enabled=tbo)):
            final, aux = _forward(m, input_ids(num_tokens, spec.tiny.vocab_size), mode, tbo=tbo)
    finally:
        spec.configure(m, [])
    packed = as_packed(aux)
    want = sorted(set(layers_to_capture))
    if final_layer_capture == "post_norm":
        # The last layer's capture (index num_layers) is the final norm's output.
        refs = refs[:spec.tiny.num_layers] + [ref_final]
    hidden = spec.tiny.hidden_size
    parts = list(aux) if isinstance(aux, (list, tuple)) else ([] if aux is None else [aux])
    shares = [i for i, t in enumerate(parts)
              if t.untyped_storage().data_ptr() == final.untyped_storage().data_ptr()]
    return {
        "rank": rank,
        "world_size": world_size,
        "captures": None if packed is None else packed.cpu().clone(),
        "expected": torch.cat([refs[i] for i in want], dim=-1).cpu(),
        "num_expected": len(want),
        "num_captured": 0 if packed is None else packed.shape[-1] // hidden,
        "returned_packed": isinstance(aux, torch.Tensor),
        "final": final.cpu().clone(),
        "reference_final": ref_final.cpu().clone(),
        "shares_storage_with_final": shares,
        "tbo_layers": sum(tbo_layers),
    }


# What SGLang's TBO plan asks of the GPU and of DeepEP (prefill plans split the SMs
# between DeepGEMM and DeepEP), answered as an H200 with DeepEP's default SM share would.
GPU_SMS = 132
DEEPEP_SMS = 20


def tbo_plan(layers, forward_batch):
    """SGLang's own two-batch-overlap plan for ``layers`` (``OperationsStrategy.init_new_tbo``,
    which the real executor computes first): it raises for a layer class TBO has no plan
    for (NotImplementedError) or a dense DeepSeek layer (AssertionError), as on a GPU.
    Only the GPU's SM count and DeepEP's SM share are answered on the CPU."""
    import types
    import unittest.mock as mock

    from sglang.srt.batch_overlap import operations_strategy as strategies

    class _DeepEPConfig:
        @staticmethod
        def get_instance():
            return types.SimpleNamespace(num_sms=DEEPEP_SMS)

    mode = getattr(forward_batch, "global_forward_mode", None) or forward_batch.forward_mode
    with mock.patch.object(strategies.torch.cuda, "get_device_properties",
                           lambda *a, **k: types.SimpleNamespace(multi_processor_count=GPU_SMS)), \
            mock.patch.object(strategies, "DeepEPConfig", _DeepEPConfig):
        return strategies.OperationsStrategy.init_new_tbo(layers, mode)


@contextlib.contextmanager
def serving_final_layer_capture(value: str, model):
    """``model``'s final-layer capture set to ``value`` for the block, as the model
    runner sets it (``set_final_layer_capture``, patch final-layer-capture), then back to
    ``pre_norm``. 0.5.23's series holds it on the model's capturing modules
    (``set_final_layer_capture(model, value)``); the pin's, process-wide
    (``set_final_layer_capture(value)``). ``pre_norm`` touches nothing, so a tree
    without the setting runs the default; any other value needs it (ImportError there)."""
    if value == "pre_norm":
        yield
        return
    import inspect

    from sglang.srt.layers.aux_hidden_states import set_final_layer_capture

    per_model = len(inspect.signature(set_final_layer_capture).parameters) == 2

    def serve(v):
        if per_model:
            set_final_layer_capture(model, v)
        else:
            set_final_layer_capture(v)

    serve(value)
    try:
        yield
    finally:
        serve("pre_norm")


@contextlib.contextmanager
def _tbo_executor(model, calls: List[int], enabled: bool):
    """Replace the two-batch-overlap executor where the model's forward looks it up
    (``model_forward_maybe_tbo``; 0.5.23: ``model_forward_stages``).

    The stand-in first computes SGLang's own plan for the layers (:func:`tbo_plan`), so
    whatever TBO refuses is refused here too; then it runs the layers in order, with the
    same math and, like the plan's operations, no captures."""
    import inspect
    import unittest.mock as mock

    if not enabled:
        yield
        return
    module = inspect.getmodule(type(model).forward)

    def sequential_tbo(layers, enable_tbo, positions, forward_batch, hidden_states, residual,
                       input_data_scatter_mode=None, zero_allocator=None, **_):
        tbo_plan(layers, forward_batch)
        calls.append(len(layers))
        for layer in layers:
            params = inspect.signature(layer.forward).parameters
            kwargs = dict(positions=positions, hidden_states=hidden_states,
                          forward_batch=forward_batch, residual=residual)
            if "zero_allocator" in params:
                kwargs["zero_allocator"] = zero_allocator
            out = layer(**kwargs)
            hidden_states, residual = out[0], out[1]
        return hidden_states, residual

    if hasattr(module, "model_forward_stages"):
        # 0.5.23: layers return hidden_states only (the residual lives in
        # forward_batch.residual_stream) and the TBO executor is model_forward_stages.
        def sequential_stages(layers, enable_tbo, positions, forward_batch, hidden_states,
                              zero_allocator=None, **_):
            tbo_plan(layers, forward_batch)
            calls.append(len(layers))
            for layer in layers:
                params = inspect.signature(layer.forward).parameters
                kwargs = dict(positions=positions, hidden_states=hidden_states,
                              forward_batch=forward_batch)
                if "zero_allocator" in params:
                    kwargs["zero_allocator"] = zero_allocator
                out = layer(**kwargs)
                hidden_states = out[0] if isinstance(out, tuple) else out
            return hidden_states

        with mock.patch.object(module, "model_forward_stages", sequential_stages):
            yield
        return
    if not hasattr(module, "model_forward_maybe_tbo"):
        raise RuntimeError(f"{module.__name__} has no model_forward_maybe_tbo: no TBO path")
    with mock.patch.object(module, "model_forward_maybe_tbo", sequential_tbo):
        yield



def deepstack_case(rank: int, world_size: int, *, model: str, layers_to_capture: Sequence[int],
                   fusion: str = "off", num_tokens: int = 6) -> Dict[str, Any]:
    """The model's forward with Qwen3-VL deepstack features on every token (integer
    valued, for the first three layers, ``input_deepstack_embeds``), captures requested
    through its setter; final hidden states and packed captures, for cross-TP checks."""
    import torch

    from harness.standins.kernels import device, fusion_mode, model_dtype
    from harness.standins.models import specs

    spec = specs()[model]
    m = get_model(model)
    g = torch.Generator().manual_seed(17)
    hidden = spec.tiny.hidden_size
    deepstack = torch.randint(-2, 3, (num_tokens, 3 * hidden), generator=g)
    deepstack = deepstack.to(device=device(), dtype=model_dtype(spec.tiny))
    spec.configure(m, layers_to_capture)
    try:
        with fusion_mode(fusion):
            final, aux = _forward(m, input_ids(num_tokens, spec.tiny.vocab_size),
                                  input_deepstack_embeds=deepstack)
    finally:
        spec.configure(m, [])
    packed = as_packed(aux)
    return {"rank": rank, "final": final.cpu().clone(),
            "captures": None if packed is None else packed.cpu().clone()}

def model_matrix(rank: int, world_size: int, cases: Sequence[Dict[str, Any]]):
    """Runs many cases in one call; a failing case returns its traceback, not raises."""
    out = []
    for case in cases:
        try:
            out.append(capture_case(rank, world_size, **case))
        except Exception:
            out.append({"rank": rank, "error": traceback.format_exc()})
    return out


def _tensors(out) -> List[Any]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    flat: List[Any] = []
    for x in out if isinstance(out, (list, tuple)) else [out]:
        flat += _tensors(x) if x is not None else []
    return flat


def compiled_matches_eager(name: str, layers_to_capture: Sequence[int], num_tokens: int = 6,
                           fullgraph: bool = True, final_layer_capture: str = "pre_norm",
                           **inputs):
    """(eager outputs, compiled outputs, graph-break reasons) of the model's real forward
    with these captures (the last layer's taken ``final_layer_capture``, as
    :func:`capture_case` sets it) and the forward's extra ``inputs`` (e.g.
    ``input_deepstack_embeds``).

    The compile is ``torch.compile(fullgraph=True, backend="eager")``, as SGLang's
    piecewise CUDA graph compiles the model forward (with its own backend) on CUDA; a
    graph break raises. With ``fullgraph=False`` the breaks are allowed and their
    reasons returned (Dynamo's ``graph_break`` counters), for a base that cannot trace
    fullgraph itself. Dynamo is on only for this compile (ranks run with it off).
    """
    from torch._dynamo.utils import counters

    import torch

    from harness.standins.batch import make_forward_batch
    from harness.standins.kernels import device
    from harness.standins.models import specs

    spec = specs()[name]
    model = get_model(name)
    ids = input_ids(num_tokens, spec.tiny.vocab_size).to(device())
    positions = torch.arange(num_tokens, dtype=torch.int64, device=ids.device)

    class Compiled:
        """The model, but calling it runs ``torch.compile(model.forward, fullgraph=True)``:
        the spec's run hook (contexts it enters around the forward) stays eager."""

        def __init__(self, forward):
            self._forward = forward

        def __call__(self, *args, **kwargs):
            return self._forward(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    spec.configure(model, layers_to_capture)
    try:
        with serving_final_layer_capture(final_layer_capture, model), torch.no_grad():
            eager = [t.clone() for t in _tensors(spec.run(model, ids, positions, make_forward_batch(ids),
                                                          **inputs))]
            with torch._dynamo.config.patch(disable=False):
                torch._dynamo.reset()
                counters.clear()
                compiled_model = Compiled(torch.compile(model.forward, fullgraph=fullgraph, backend="eager"))
                out = spec.run(compiled_model, ids, positions, make_forward_batch(ids), **inputs)
                compiled = [t.clone() for t in _tensors(out)]
                breaks = sorted(str(reason) for reason in counters["graph_break"])
                torch._dynamo.reset()
    finally:
        spec.configure(model, [])
    return eager, compiled, breaks
