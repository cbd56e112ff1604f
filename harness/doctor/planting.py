"""Features with a planted convention, made the way trainers make them, for the demo and
the tests (:mod:`harness.doctor.cases`).

Two trainer-shaped paths, each independent of the doctor's own term code:

* **transformers** (:func:`transformers_features`), as a trainer's HF backend does:
  ``output_hidden_states`` of the target, entry ``id + 1`` per id in SGLang's meaning or
  entry ``id`` in vLLM's (the last entry is after the final norm, so an id of the last
  layer in SGLang's meaning plants ``post_norm``). Options emulate the other trainers:
  a forward pre-hook on the final norm for a ``pre_norm`` last slot; transformers 4.57's
  in-place deepstack (``_deepstack_process`` without its ``clone``, so the recorded
  outputs of the first layers hold the deepstack addition: ``post_deepstack``,
  sgl-project/SpecForge#431); a capture of Gemma's post-feedforward norm output
  alone, without the residual (what SGLang 0.5.23's gemma3 captured,
  sgl-project/sglang#39286);
* **engine** (:func:`engine_features`, SGLang 0.5.23 only): this project's patched
  Engine with ``--enable-return-aux-hidden-states``, the rows of the prompt
  (sgl-project/SpecForge#641).

Saved as SpecForge's offline format (a torch file) or a safetensors file.
Stdlib-only at import time.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Sequence


def _decoder(model, final_norm: str):
    parent = functools.reduce(getattr, final_norm.rsplit(".", 1)[0].split("."), model)
    return parent, parent.layers


def transformers_features(model, final_norm: str, input_ids: Sequence[int], ids: Sequence[int], *,
                          meaning: str = "sglang", last: str = "hidden_states",
                          deepstack: str = "transformers5", residual: bool = True,
                          extra: Optional[dict[str, Any]] = None) -> tuple[Any, Any]:
    """``(aux [T, K * H], hidden_state [T, H])`` of ``input_ids`` for the draft ``ids``
    (see the module docstring for each option)."""
    import torch

    norm = functools.reduce(getattr, final_norm.split("."), model)
    text_model, layers = _decoder(model, final_norm)
    num = len(layers)
    index = [i + 1 for i in ids] if meaning == "sglang" else list(ids)
    handles, seen_norm, branch = [], [], {}
    if last == "pre_norm":
        handles.append(norm.register_forward_pre_hook(lambda _m, args: seen_norm.append(args[0].detach().clone())))
    if not residual:
        for i in index:
            sub = layers[i - 1].post_feedforward_layernorm
            handles.append(sub.register_forward_hook(
                lambda _m, _a, out, i=i: branch.__setitem__(i, out.detach().clone())))
    if deepstack == "4.57":
        def in_place(hidden_states, visual_pos_masks, visual_embeds):
            # transformers 4.57: no clone, so the recorded layer output holds the sum too.
            hidden_states[visual_pos_masks.to(hidden_states.device), :] += visual_embeds.to(hidden_states.dtype)
            return hidden_states
        text_model._deepstack_process = in_place
    kwargs = dict(extra or {})
    if "mm_token_type_ids" in kwargs:   # saved per token; the model takes a batch of one
        kwargs["mm_token_type_ids"] = kwargs["mm_token_type_ids"].reshape(1, -1)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([list(input_ids)]), output_hidden_states=True,
                        use_cache=False, **kwargs)
    finally:
        for h in handles:
            h.remove()
        if deepstack == "4.57":
            del text_model._deepstack_process
    slots = []
    for i in index:
        if not residual:
            slots.append(branch[i][0])
        elif i == num and last == "pre_norm":
            slots.append(seen_norm[0][0])
        else:
            slots.append(out.hidden_states[i][0])
    return torch.cat(slots, dim=-1).float(), out.hidden_states[num][0].float()


def engine_features(session, target: Path, family_setup: str, input_ids: Sequence[int], ids: Sequence[int],
                    method: str, final_layer_capture: Optional[str] = None) -> Any:
    """The prompt rows SGLang's patched Engine returns with ``--enable-return-aux-hidden-states``
    for the ``ids`` of ``method``'s convention (``[T, K * H]``)."""
    from harness.e2e.engine import EngineConfig, EngineError
    from harness.e2e.features import rows_of

    extra: dict[str, Any] = dict(enable_return_aux_hidden_states=True, speculative_algorithm=method,
                                 return_aux_hidden_state_layer_ids=list(ids), attention_backend="torch_native",
                                 skip_tokenizer_init=True)
    if final_layer_capture:
        extra["speculative_final_layer_capture"] = final_layer_capture
    key = f"doctor-{Path(target).name}-{method.lower()}-{final_layer_capture or 'pre_norm'}"
    config = EngineConfig(key=key, model=Path(target).name, target=str(target), extra=tuple(extra.items()),
                          setup=(family_setup,) if family_setup else ())
    session.ensure(config)
    got = session.generate(None, {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
                           input_ids=[list(input_ids)], return_hidden_states=True)
    rows = rows_of(got[0].get("hidden_states"))
    if rows.shape[0] != len(input_ids):
        raise EngineError(f"{key}: {rows.shape[0]} rows for a prompt of {len(input_ids)} tokens")
    return rows


def save(path: Path, input_ids: Sequence[int], aux, hidden_state, fmt: str = "torch",
         extra: Optional[dict[str, Any]] = None) -> Path:
    """A features file: SpecForge's offline torch format (``aux_hidden_state`` and
    ``hidden_state`` with a leading batch dimension, as its ``prepare_hidden_states``
    writes them) or safetensors with the same keys."""
    import torch

    ids = torch.tensor(list(input_ids), dtype=torch.long)
    data = {"input_ids": ids, "loss_mask": torch.ones_like(ids),
            "aux_hidden_state": aux.unsqueeze(0).contiguous(), "hidden_state": hidden_state.unsqueeze(0).contiguous()}
    data.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in data.items()}, str(path))
    else:
        torch.save(data, str(path))
    return path
