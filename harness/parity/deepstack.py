"""Qwen3-VL deepstack against transformers: the language model with visual features.

Qwen3-VL adds "deepstack" visual features to the stream of image tokens after each of
its first few decoder layers, so a capture of index ``k <= 3`` is taken next to that
addition, on one side of it or the other. Text-only parity (:mod:`harness.parity.runner`)
never exercises that path, so this module drives the language models directly, on both
sides:

* transformers: ``model.model.language_model(inputs_embeds, visual_pos_masks,
  deepstack_visual_embeds, output_hidden_states=True)`` with every token an image
  token: ``hidden_states[k]`` is decoder layer ``k - 1``'s output *before* its deepstack
  (transformers 5 adds it to a clone), the ``pre_deepstack`` value; the stream entering
  decoder layer ``k`` (a forward pre-hook) is that plus ``deepstack[k - 1]``, the
  ``post_deepstack`` value (what transformers 4.57 recorded in place); what the final
  norm receives (``pre_norm``) and the output;
* SGLang: the wrapper's language model (``model.model``) with ``input_deepstack_embeds``
  (``[tokens, layers * hidden]``, what ``general_mm_embed_routine`` hands it), every
  layer captured through the model runner's setup function, once per
  ``deepstack_capture`` setting (unset: the model's default), and on 0.5.23 on both of
  its deepstack orders (the inference path, and the HF-order path that
  ``--rl-on-policy-target`` selects through ``use_hf_deepstack_order``).

Stdlib-only at import time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from harness.parity.families import Family

# Layers whose output gets deepstack features (the vision tower's deepstack mergers).
DEEPSTACK_LAYERS = 3
# The deepstack_capture settings a case requests, in order on one loaded model (None:
# unset, the model's own default, so it goes first).
SETTINGS = (None, "pre_deepstack", "post_deepstack")
# 0.5.23's two deepstack orders (Qwen3LLMModel.use_hf_deepstack_order False / True).
ORDERS = ("inference", "hf")


def family(fam: Family) -> Family:
    """``fam`` with a vision tower that feeds deepstack into the first three layers."""

    def config():
        cfg = fam.config()
        cfg["vision_config"] = dict(cfg["vision_config"],
                                    deepstack_visual_indexes=list(range(DEEPSTACK_LAYERS)))
        return cfg

    return dataclasses.replace(fam, config=config)


def embeds(total_tokens: int, hidden: int, seed: int = 5):
    """Deepstack features for every token: ``[DEEPSTACK_LAYERS, tokens, hidden]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(DEEPSTACK_LAYERS, total_tokens, hidden, generator=g)


def reference(model, prompt_ids: Sequence[Sequence[int]], deepstack) -> dict[str, Any]:
    """transformers' language model on ``prompt_ids`` (one at a time), every token an
    image token with ``deepstack`` features: its ``hidden_states``, the stream entering
    each decoder layer and the final norm, and the output."""
    import torch

    lm = model.model.language_model
    entering: dict[int, list] = {i: [] for i in range(len(lm.layers))}
    pre_norm: list = []

    def take(store):
        def hook(_module, args, kwargs):
            store.append((args[0] if args else kwargs["hidden_states"])[0].detach().clone())
        return hook

    handles = [layer.register_forward_pre_hook(take(entering[i]), with_kwargs=True)
               for i, layer in enumerate(lm.layers)]
    handles.append(lm.norm.register_forward_pre_hook(take(pre_norm), with_kwargs=True))
    hidden: list[list] = []
    finals, start = [], 0
    try:
        with torch.no_grad():
            for ids in prompt_ids:
                n = len(ids)
                out = lm(inputs_embeds=lm.embed_tokens(torch.tensor([list(ids)])),
                         visual_pos_masks=torch.ones(1, n, dtype=torch.bool),
                         deepstack_visual_embeds=[d[start:start + n] for d in deepstack],
                         use_cache=False, output_hidden_states=True)
                hidden.append([h[0] for h in out.hidden_states])
                finals.append(out.last_hidden_state[0])
                start += n
    finally:
        for h in handles:
            h.remove()
    num_layers = len(lm.layers)
    if num_layers <= DEEPSTACK_LAYERS:
        raise ValueError(f"the deepstack checkpoint needs more than {DEEPSTACK_LAYERS} "
                         f"layers (its last layer would take deepstack), got {num_layers}")
    return {
        "hidden_states": [torch.cat([h[i] for h in hidden]) for i in range(num_layers + 1)],
        "entering": [torch.cat(entering[i]) for i in range(num_layers)],
        "pre_norm": torch.cat(pre_norm),
        "final": torch.cat(finals),
        "num_layers": num_layers,
    }


def expected(ref: dict, deepstack, index: int, post: bool):
    """What a capture of ``index`` holds, from transformers' own tensors: the stream
    entering the final norm for the last layer; else ``hidden_states[index]``, plus
    ``deepstack[index - 1]`` on the image rows (every row) where ``post``."""
    if index == ref["num_layers"]:
        return ref["pre_norm"]
    want = ref["hidden_states"][index]
    if post and 1 <= index <= DEEPSTACK_LAYERS:
        want = want + deepstack[index - 1]
    return want


def _orders(model) -> list:
    """The deepstack orders this base's language model has (the pin: one)."""
    lm = model.model
    return list(ORDERS) if hasattr(lm, "use_hf_deepstack_order") else [ORDERS[0]]


def run_case(checkpoint: str, prompts, tp: int, deepstack, fusions: Sequence[str],
             settings: Sequence[Optional[str]] = SETTINGS) -> list:
    """SGLang's language model with deepstack, every layer captured (EAGLE3 ids
    ``0 .. L-1`` through the model runner's setup function) once per setting, in
    every deepstack order the base has and every fusion mode: one result per
    (setting, order, fusion), each naming its ``setting`` and ``order``."""
    import traceback

    import torch

    from harness.parity import runner
    from harness.standins.cpu_kernels import cuda_norm
    from harness.standins.kernels import fusion_mode

    try:
        model_config, model = runner.load(checkpoint)
        cuda_norm.install(model)
        num_layers = model_config.hf_text_config.num_hidden_layers
        orders = _orders(model)
    except Exception:
        err = traceback.format_exc()
        return [{"error": err, "setting": s, "order": o, "fusion": f}
                for s in settings for o in ORDERS for f in fusions]
    # [tokens, layers * hidden], as general_mm_embed_routine hands it to the language model.
    flat = torch.cat(list(deepstack), dim=-1)
    results = []
    for setting in settings:
        try:
            runner.request_captures(model, eagle3=list(range(num_layers)),
                                    deepstack_capture=setting)
            ltc = runner._layers_to_capture(model)
            request_error = None
        except Exception:
            request_error = traceback.format_exc()
        for order in orders:
            if len(orders) > 1:
                model.model.use_hf_deepstack_order = order == "hf"
            for fusion in fusions:
                key = {"setting": setting, "order": order, "fusion": fusion}
                if request_error is not None:
                    results.append({"error": request_error, **key})
                    continue
                try:
                    fb = runner.Requests(model, model_config, [len(p) for p in prompts],
                                         tp).extend(prompts)
                    with (torch.no_grad(), runner._forward_context(fb.attn_backend),
                          fusion_mode(fusion)):
                        out = model.model(fb.input_ids, fb.mrope_positions, fb,
                                          input_deepstack_embeds=flat)
                    final, aux = out if isinstance(out, tuple) else (out, None)
                    if aux is not None and not isinstance(aux, torch.Tensor):  # a list
                        aux = torch.cat(list(aux), dim=-1)
                    result = {"final": final.detach().clone(), "layers_to_capture": ltc,
                              "aux": None if aux is None else aux.detach().clone(), **key}
                    if setting == "pre_deepstack" and aux is not None:
                        result["alone"] = _without_each_deepstack(
                            model, model_config, prompts, tp, flat, fusion, aux.shape[-1])
                    results.append(result)
                except Exception:
                    results.append({"error": traceback.format_exc(), **key})
    return results


def _without_each_deepstack(model, model_config, prompts, tp, flat, fusion, width):
    """Per deepstack layer ``j``: the packed captures of a forward whose deepstack for
    layer ``j`` alone is zero. The output of layer ``j`` does not depend on it, so that
    forward's capture of index ``j + 1`` is layer ``j``'s output bit for bit, the value
    a ``pre_deepstack`` capture must hold exactly (a capture that takes the stream
    after the addition and subtracts the deepstack again is off in the last bits)."""
    import torch

    from harness.parity import runner
    from harness.standins.kernels import fusion_mode

    hidden = flat.shape[-1] // DEEPSTACK_LAYERS
    out = {}
    for j in range(DEEPSTACK_LAYERS):
        zeroed = flat.clone()
        zeroed[:, j * hidden:(j + 1) * hidden] = 0
        fb = runner.Requests(model, model_config, [len(p) for p in prompts], tp).extend(prompts)
        with torch.no_grad(), runner._forward_context(fb.attn_backend), fusion_mode(fusion):
            res = model.model(fb.input_ids, fb.mrope_positions, fb, input_deepstack_embeds=zeroed)
        aux = res[1]
        if not isinstance(aux, torch.Tensor):
            aux = torch.cat(list(aux), dim=-1)
        assert aux.shape[-1] == width
        out[j + 1] = aux.detach().clone()
    return out


def run(rank: int, world_size: int, cases: Sequence[dict]) -> list:
    """Rank task: every case (``checkpoint``, ``prompts``, ``deepstack``, ``fusions``)."""
    return [run_case(c["checkpoint"], c["prompts"], world_size, c["deepstack"], c["fusions"])
            for c in cases]
