"""Qwen3-VL deepstack against transformers: the language model with visual features.

Qwen3-VL adds "deepstack" visual features to the stream of image tokens after each of
its first few decoder layers. Text-only parity (:mod:`harness.parity.runner`) never
exercises that path, so this module drives the language models directly, on both sides:

* transformers: ``model.model.language_model(inputs_embeds, visual_pos_masks,
  deepstack_visual_embeds)`` with every token an image token; what each decoder layer
  receives (a forward pre-hook: the stream entering layer ``i``, deepstack of layer
  ``i - 1`` included), what the final norm receives (``pre_norm``) and the output;
* SGLang: the wrapper's language model (``model.model``) with ``input_deepstack_embeds``
  (``[tokens, layers * hidden]``, what ``general_mm_embed_routine`` hands it), captures
  requested through the model runner's setup function for every layer.

Every capture of index ``i`` is checked against the stream entering layer ``i``, which
is what 0.5.23 captures at its layer boundary in every Qwen3-VL model. (transformers'
``output_hidden_states`` records each decoder layer's output *before* the model adds
that layer's deepstack, so for image tokens its entries 1-3 are not the stream the next
layer receives.) Stdlib-only at import time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from harness.parity.families import Family

# Layers whose output gets deepstack features (the vision tower's deepstack mergers).
DEEPSTACK_LAYERS = 3


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
    image token with ``deepstack`` features."""
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
    finals, start = [], 0
    try:
        with torch.no_grad():
            for ids in prompt_ids:
                n = len(ids)
                out = lm(inputs_embeds=lm.embed_tokens(torch.tensor([list(ids)])),
                         visual_pos_masks=torch.ones(1, n, dtype=torch.bool),
                         deepstack_visual_embeds=[d[start:start + n] for d in deepstack],
                         use_cache=False)
                finals.append(out.last_hidden_state[0])
                start += n
    finally:
        for h in handles:
            h.remove()
    return {
        "entering": [torch.cat(entering[i]) for i in range(len(lm.layers))],
        "pre_norm": torch.cat(pre_norm),
        "final": torch.cat(finals),
        "num_layers": len(lm.layers),
    }


def run_case(checkpoint: str, prompts, tp: int, deepstack, fusions: Sequence[str]) -> list:
    """SGLang's language model with deepstack, every layer captured (EAGLE3 ids
    ``0 .. L-1`` through the model runner's setup function); one result per fusion."""
    import traceback

    import torch

    from harness.parity import runner
    from harness.standins.kernels import fusion_mode, install_cpu_norm

    try:
        model_config, model = runner.load(checkpoint)
        if tp > 1:
            install_cpu_norm(model)
        num_layers = model_config.hf_text_config.num_hidden_layers
        runner.request_captures(model, eagle3=list(range(num_layers)))
        ltc = runner._layers_to_capture(model)
    except Exception:
        return [{"error": traceback.format_exc()} for _ in fusions]
    # [tokens, layers * hidden], as general_mm_embed_routine hands it to the language model.
    flat = torch.cat(list(deepstack), dim=-1)
    results = []
    for fusion in fusions:
        try:
            fb = runner.Requests(model, model_config, [len(p) for p in prompts], tp).extend(prompts)
            with torch.no_grad(), runner._forward_context(fb.attn_backend), fusion_mode(fusion):
                out = model.model(fb.input_ids, fb.mrope_positions, fb,
                                  input_deepstack_embeds=flat)
            final, aux = out if isinstance(out, tuple) else (out, None)
            if aux is not None and not isinstance(aux, torch.Tensor):  # 0.5.23's list
                aux = torch.cat(list(aux), dim=-1)
            results.append({"final": final.detach().clone(), "layers_to_capture": ltc,
                            "aux": None if aux is None else aux.detach().clone()})
        except Exception:
            results.append({"error": traceback.format_exc()})
    return results


def run(rank: int, world_size: int, cases: Sequence[dict]) -> list:
    """Rank task: every case (``checkpoint``, ``prompts``, ``deepstack``, ``fusions``)."""
    return [run_case(c["checkpoint"], c["prompts"], world_size, c["deepstack"], c["fusions"])
            for c in cases]
