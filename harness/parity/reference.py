"""transformers' side of the parity tier: a tiny checkpoint and what it computes.

:func:`make_checkpoint` writes a random-weight checkpoint of a family with
``save_pretrained`` (seeded, float32), every 1-D tensor it holds moved off transformers'
initialisation first (:func:`perturb`). :func:`reference` runs transformers on each
request's whole token sequence (its prompt, then the tokens :func:`appended_tokens`
gives it: the decode token and the verify chain SGLang's later batches forward), one
request at a time, and returns per token, for the rows each SGLang forward holds
(``rows``: the prompts for the extend, as SGLang packs them, then each request's decode
token, then each request's verify chain; ``modes`` holds the later forwards' entries):

* ``hidden_states[i]`` for ``i = 0 .. L``: transformers' ``output_hidden_states``.
  Entry ``i < L`` is the stream entering layer ``i`` (what an in-loop capture of index
  ``i`` must hold); entry ``L`` is after the final norm (the ``post_norm`` value);
* ``pre_norm``: the stream entering the final norm, taken with a forward pre-hook
  (the ``pre_norm`` value of a last-layer capture);
* ``final``: the final hidden states (entry ``L``), and ``logits``: the next-token
  logits SGLang hands on (each prompt's last token for the extend, every token of a
  decode or verify batch).

transformers is causal, so a token's entries do not depend on the tokens after it: one
run over the whole sequence gives every forward's reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from harness.parity.families import Family
from harness.parity.runner import APPENDED, VERIFY_TOKENS

# Two prompts of different lengths: an extend batch of two requests (so packing,
# per-request attention and last-token pruning all run).
PROMPT_LENGTHS = (7, 5)

# The common perturbation (:func:`perturb`): the half-width of the uniform noise added
# to every 1-D tensor of a checkpoint, by kind.
PERTURB_BIAS = 0.2
PERTURB_OTHER = 0.5


def prompts(vocab_size: int, seed: int = 11) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def appended_tokens(vocab_size: int, seed: int = 13) -> list[list[int]]:
    """Each request's tokens after its prompt (``runner.APPENDED``): its decode token, then
    its verify chain (the bonus token and the drafts). Seeded, not sampled: the forwards
    are compared value for value on the same tokens, whichever they are."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (APPENDED,), generator=g).tolist()
            for _ in PROMPT_LENGTHS]


def one_dimensional(model) -> dict[str, Any]:
    """Every 1-D floating-point tensor a checkpoint of ``model`` holds, by name: its 1-D
    parameters and its persistent 1-D buffers (routers' ``e_score_correction_bias``,
    Gemma 4's ``layer_scalar``)."""
    persistent = model.state_dict(keep_vars=True)
    return {name: t for name, t in sorted(persistent.items())
            if t.dim() == 1 and t.is_floating_point()}


def perturb(model, seed: int = 1) -> None:
    """Move every 1-D tensor of ``model``'s checkpoint (:func:`one_dimensional`) off
    transformers' initialisation, in place.

    transformers initialises every norm weight to 1 (a zero-centred norm's, used as
    ``1 + w``, to 0: Gemma's, Qwen3-Next's), every bias and router correction bias to 0
    and Gemma 4's layer scalars to 1, so a capture taken through the wrong norm, a norm
    weight that failed to load or a bias left out would match. Each gets seeded uniform
    noise added: ``U(-PERTURB_BIAS, PERTURB_BIAS)`` for a bias (``*bias``),
    ``U(-PERTURB_OTHER, PERTURB_OTHER)`` for any other (norm weights around 1, or around
    0 for zero-centred norms; mixer vectors such as ``A_log``, ``D``, ``dt_bias``;
    per-head sinks; scales). Tensors are drawn in name order, so the values depend on
    the seed and the architecture only."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in one_dimensional(model).items():
            width = PERTURB_BIAS if name.endswith("bias") else PERTURB_OTHER
            noise = (torch.rand(tensor.shape, generator=g, dtype=torch.float64) * 2 - 1) * width
            tensor.add_(noise.to(tensor.dtype))


def _module(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _no_hub_kernels() -> None:
    """transformers' own torch paths, never a kernel fetched from the Hub.

    With the ``kernels`` package installed (it is in both locks), some modeling files
    (the Mamba2 mixers of granitemoehybrid and other hybrids) call ``lazy_load_kernel``
    while the model is built. Offline that stalls for minutes and then raises (5.8.1:
    "could not verify publisher trust status"). ``USE_HUB_KERNELS=0`` turns it off where
    transformers reads it; 5.8.1's ``lazy_load_kernel`` reads only ``_kernels_available``.
    """
    import os

    os.environ["USE_HUB_KERNELS"] = "0"
    from transformers.integrations import hub_kernels

    for flag in ("_kernels_enabled", "_kernels_available"):
        if getattr(hub_kernels, flag, False):
            setattr(hub_kernels, flag, False)


def hf_model(family: Family, seed: int = 0, perturbed: bool = True):
    """A fresh transformers model of ``family`` with seeded random weights (float32),
    every 1-D tensor perturbed (:func:`perturb`; ``perturbed=False``: transformers' own
    init, for the tests of that step), then the family's own ``prepare``."""
    import torch
    import transformers

    _no_hub_kernels()
    config_cls = getattr(transformers, family.hf_config_class)
    model_cls = getattr(transformers, family.hf_model_class)
    config = config_cls(**family.config())
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    if perturbed:
        perturb(model, seed + 1)
    if family.prepare is not None:
        with torch.no_grad():
            family.prepare(model)
    return model


def make_checkpoint(family: Family, directory: Path, seed: int = 0, perturbed: bool = True):
    """Write ``family``'s tiny checkpoint to ``directory``; returns the transformers model
    (``perturbed``: see :func:`hf_model`)."""
    model = hf_model(family, seed, perturbed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    if family.config_json:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        data.update(family.config_json)
        path.write_text(json.dumps(data, indent=2) + "\n")
    return model


def rows(prompt_lengths: Sequence[int]) -> dict[str, list[int]]:
    """Which tokens of the requests' whole sequences (concatenated, request by request)
    each SGLang forward holds, in its order, and whose next-token logits it hands on
    (``"<mode>_logits"``)."""
    out: dict[str, list[int]] = {"extend": [], "extend_logits": [], "decode": [], "verify": []}
    start = 0
    for n in prompt_lengths:
        out["extend"] += list(range(start, start + n))
        out["extend_logits"].append(start + n - 1)
        out["decode"].append(start + n)
        out["verify"] += list(range(start + n + 1, start + n + 1 + VERIFY_TOKENS))
        start += n + APPENDED
    out["decode_logits"], out["verify_logits"] = out["decode"], out["verify"]
    return out


def reference(family: Family, model, prompt_ids: Sequence[Sequence[int]],
              appended: Sequence[Sequence[int]]) -> dict[str, Any]:
    """What transformers computes for each request's ``prompt_ids`` + ``appended`` (see
    the module docstring): the extend's entries, and ``modes``: {"decode", "verify"}
    each with the same keys for its rows."""
    import torch

    norm = _module(model, family.hf_final_norm)
    seen: list = []
    handle = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    hidden: list[list] = []
    pre_norm, logits = [], []
    try:
        with torch.no_grad():
            for ids, more in zip(prompt_ids, appended):
                seen.clear()
                sequence = list(ids) + list(more)
                out = model(torch.tensor([sequence]), output_hidden_states=True, use_cache=False)
                if len(seen) != 1:
                    raise RuntimeError(
                        f"{family.name}: transformers' {family.hf_final_norm} ran {len(seen)} times"
                    )
                hidden.append([h[0] for h in out.hidden_states])
                pre_norm.append(seen[0][0])
                logits.append(out.logits[0])
    finally:
        handle.remove()
    n_entries = {len(h) for h in hidden}
    if len(n_entries) != 1:
        raise RuntimeError(f"{family.name}: hidden_states entries differ between prompts")
    every = {
        "hidden_states": [torch.cat([h[i] for h in hidden]) for i in range(n_entries.pop())],
        "pre_norm": torch.cat(pre_norm),
        "logits": torch.cat(logits),
    }
    at = rows([len(ids) for ids in prompt_ids])

    def forward(mode: str) -> dict[str, Any]:
        index = torch.tensor(at[mode])
        hidden_states = [h[index] for h in every["hidden_states"]]
        return {"hidden_states": hidden_states, "pre_norm": every["pre_norm"][index],
                "final": hidden_states[-1],
                "logits": every["logits"][torch.tensor(at[f"{mode}_logits"])]}

    out = forward("extend")
    out["num_layers"] = len(out["hidden_states"]) - 1
    out["modes"] = {mode: forward(mode) for mode in ("decode", "verify")}
    return out
