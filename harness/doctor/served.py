"""What this server feeds a draft, slot by slot, in transformers' terms.

Two steps, both through the patched SGLang's own code (in a rank of the parity tier's
pool: SGLang's CPU engine mode, :mod:`harness.parity.runner`):

1. **Resolve** the draft's ids and settings as the model runner does at start-up:
   on 0.5.23 its resolver ``resolve_spec_aux_hidden_state_config``
   (``model_runner_components/spec_aux_hidden_state.py``), given the server arguments
   (the draft path, ``--speculative-final-layer-capture``,
   ``--speculative-deepstack-capture``; set on the runtime context's ``spec`` namespace,
   because this CPU's platform refuses DFLASH before any resolver runs); at the pin, whose
   ``ModelRunner.__init__`` reads the EAGLE3 ids inline (``model_runner.py:452-475``), the
   same two ``eagle_config`` reads, then SGLang's own ``resolve_final_layer_capture`` /
   ``resolve_deepstack_capture`` and DFlash's ``parse_dflash_draft_config(...)
   .resolve_target_layer_ids``. What SGLang refuses here (an id out of range, an unknown
   setting) is the doctor's answer: the server would refuse the draft at start-up.
2. **Map** each slot: SGLang's real model, loaded by its own loader from a shrunk copy of
   the target's config (:func:`harness.doctor.target.shrunk_config`), takes the
   resolved request through the function the model runner calls
   (``harness.parity.runner.request_captures``: the model's own setters) and runs an
   extend; every slot it hands the logits processor is matched against transformers'
   terms on the same weights (:mod:`harness.doctor.terms`). Qwen3-VL's language model
   runs with deepstack features on every token (as the parity tier's deepstack module
   drives it), so the side of the deepstack addition shows.

Each variant (the draft as it is, and each proposed fix) is resolved and run on the one
loaded model. Stdlib-only at import time.
"""

from __future__ import annotations

import importlib.util
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# The rank task (harness.ranks RankPool.run).
TASK = "harness.doctor.served:serve"


def _on_0_5_23() -> bool:
    return importlib.util.find_spec("sglang.srt.model_executor.model_runner_components") is not None


def resolve(checkpoint: str, draft: str, algorithm: str, final_layer_capture: Optional[str] = None,
            deepstack_capture: Optional[str] = None) -> dict[str, Any]:
    """The capture request the model runner would make for ``draft`` on the target at
    ``checkpoint`` (keyword arguments of ``harness.parity.runner.request_captures``), and
    what it resolved: ``{"request": {...}, "method", "ids", "default_ids",
    "final_layer_capture", "deepstack_capture", "use_aux_hidden_state"}``."""
    if _on_0_5_23():
        return _resolve_0_5_23(checkpoint, draft, algorithm, final_layer_capture, deepstack_capture)
    return _resolve_pin(checkpoint, draft, algorithm, final_layer_capture, deepstack_capture)


_SERVER_ARGS: dict[str, Any] = {}


def _resolve_0_5_23(checkpoint, draft, algorithm, flc, dsc) -> dict[str, Any]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import create_context, get_spec, use_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if checkpoint not in _SERVER_ARGS:
        server_args = ServerArgs(model_path=checkpoint, device="cpu", skip_tokenizer_init=True)
        _SERVER_ARGS[checkpoint] = (server_args, create_context(server_args, role="scheduler"))
    server_args, context = _SERVER_ARGS[checkpoint]
    spec = dict(speculative_draft_model_path=draft, speculative_final_layer_capture=flc,
                speculative_deepstack_capture=dsc)
    with use_context(context), get_spec().override(**spec):
        model_config = ModelConfig.from_server_args(server_args)
        cfg = resolve_spec_aux_hidden_state_config(
            server_args=server_args, model_config=model_config,
            spec_algorithm=SpeculativeAlgorithm.from_string(algorithm), is_draft_worker=False)
    if cfg.eagle_use_aux_hidden_state:
        ids = cfg.eagle_aux_hidden_state_layer_ids
        request = {"eagle3": "default" if ids is None else list(ids)}
    elif cfg.dflash_use_aux_hidden_state:
        ids = list(cfg.dflash_target_layer_ids)
        request = {"dflash": ids, "dspark": bool(cfg.is_dspark)}
    else:
        ids, request = None, {}
    return _resolved(algorithm, request, ids, cfg.final_layer_capture, cfg.deepstack_capture)


def _resolve_pin(checkpoint, draft, algorithm, flc, dsc) -> dict[str, Any]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.aux_hidden_states import (
        resolve_deepstack_capture,
        resolve_final_layer_capture,
    )

    hf_config = ModelConfig(model_path=draft, is_draft_model=True).hf_config
    if algorithm == "EAGLE3":
        # ModelRunner.__init__ (model_runner.py:452-475 at the pin) reads these inline.
        use, ids = True, None
        eagle_config = getattr(hf_config, "eagle_config", None)
        try:
            use = eagle_config.get("use_aux_hidden_state", True)
            ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
        except Exception:
            ids = None
        final = resolve_final_layer_capture(flc, eagle_config, "eagle_config")
        deep = resolve_deepstack_capture(dsc, eagle_config, "eagle_config")
        request = ({"eagle3": "default" if ids is None else list(ids)} if use else {})
        return _resolved(algorithm, request, ids if use else None, final, deep)
    if algorithm == "DFLASH":
        from sglang.srt.speculative.dflash_utils import _get_dflash_config, parse_dflash_draft_config

        parsed = parse_dflash_draft_config(draft_hf_config=hf_config)
        layers = int(ModelConfig(model_path=checkpoint).hf_text_config.num_hidden_layers)
        ids = parsed.resolve_target_layer_ids(target_num_layers=layers,
                                              draft_num_layers=int(parsed.require_num_layers()))
        dflash_config = _get_dflash_config(hf_config)
        final = resolve_final_layer_capture(flc, dflash_config, "dflash_config")
        deep = resolve_deepstack_capture(dsc, dflash_config, "dflash_config")
        return _resolved(algorithm, {"dflash": list(ids)}, list(ids), final, deep)
    raise ValueError(f"SGLang 0.5.13.post1 has no {algorithm} (its speculative algorithms with aux "
                     "captures are EAGLE3 and DFLASH)")


def _resolved(algorithm, request, ids, final, deep) -> dict[str, Any]:
    if request:
        request = {**request, "final_layer_capture": final}
        if deep is not None:
            request["deepstack_capture"] = deep
    return {"request": request, "method": algorithm, "ids": None if ids is None else list(ids),
            "default_ids": request.get("eagle3") == "default", "final_layer_capture": final,
            "deepstack_capture": deep, "use_aux_hidden_state": bool(request)}


def _model_dtype(target: str) -> Optional[str]:
    """The dtype SGLang serves the real target in (``--dtype auto``): its ModelConfig's
    resolution of the real config (no weights read)."""
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return str(ModelConfig(model_path=target, dtype="auto").dtype).replace("torch.", "")
    except Exception as exc:  # the served mapping does not need it
        return f"unknown ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"


def _run_vl(model, model_config, prompts, deepstack) -> Any:
    """One extend of ``prompts`` through the Qwen3-VL language model with ``deepstack``
    on every token (``[tokens, layers * hidden]``, as ``general_mm_embed_routine`` hands
    it), as :func:`harness.parity.deepstack.run_case` drives it."""
    import torch

    from harness.parity import runner

    fb = runner.Requests(model, model_config, [len(p) for p in prompts], 1).extend(prompts)
    with torch.no_grad(), runner._forward_context(fb.attn_backend):
        out = model.model(fb.input_ids, fb.mrope_positions, fb, input_deepstack_embeds=deepstack)
    _final, aux = out if isinstance(out, tuple) else (out, None)
    if aux is not None and not isinstance(aux, torch.Tensor):
        aux = torch.cat(list(aux), dim=-1)
    return None if aux is None else aux.detach().clone()


def serve(rank: int, world_size: int, job: dict) -> dict:
    """Rank task: resolve each of ``job["variants"]`` (``draft``, ``algorithm``,
    ``final_layer_capture``, ``deepstack_capture``) and run it on the shrunk target
    ``job["checkpoint"]`` (loaded once). Per variant: ``resolved`` (or ``refused``: the
    one-line error SGLang raised), ``layers_to_capture`` and ``aux`` (the packed
    captures of the extend, ``[tokens, K * hidden]``)."""
    import torch

    from harness.parity import runner
    from harness.ranks.child import resolve_callable
    from harness.standins.cpu_kernels import cuda_norm

    out: dict[str, Any] = {"dtype": _model_dtype(job["target"]), "variants": []}
    setup = job.get("setup")
    if setup and setup not in runner._SETUP_DONE:
        resolve_callable(setup)()
        runner._SETUP_DONE.add(setup)
    model_config, model = runner.load(job["checkpoint"])
    cuda_norm.install(model)
    deepstack = job.get("deepstack")
    for v in job["variants"]:
        entry: dict[str, Any] = {}
        try:
            entry["resolved"] = resolve(job["checkpoint"], v["draft"], v["algorithm"],
                                        v.get("final_layer_capture"), v.get("deepstack_capture"))
            request = entry["resolved"]["request"]
            runner.request_captures(model, **request)
            entry["layers_to_capture"] = runner._layers_to_capture(model)
        except (ValueError, AttributeError, NotImplementedError) as exc:
            entry["refused"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            out["variants"].append(entry)
            continue
        if not request:
            entry["aux"] = None
        elif deepstack is not None:
            entry["aux"] = _run_vl(model, model_config, job["prompts"], deepstack)
        else:
            res = runner.run_requests(model, model_config, job["prompts"], world_size,
                                      job.get("attention", "torch_native"))
            entry["aux"] = res["aux"]
        if entry["aux"] is not None:
            entry["aux"] = entry["aux"].float()
        out["variants"].append(entry)
    del torch
    return out


@dataclass
class Variant:
    """One way to serve the draft: the draft directory and the server arguments."""

    draft: str
    algorithm: str
    final_layer_capture: Optional[str] = None   # --speculative-final-layer-capture
    deepstack_capture: Optional[str] = None     # --speculative-deepstack-capture
    label: str = "as configured"

    def job(self) -> dict[str, Any]:
        return {"draft": self.draft, "algorithm": self.algorithm,
                "final_layer_capture": self.final_layer_capture,
                "deepstack_capture": self.deepstack_capture}


@dataclass
class Served:
    """What one variant feeds: per slot, its transformers term (a Match)."""

    variant: Variant
    resolved: Optional[dict[str, Any]] = None
    refused: Optional[str] = None
    layers_to_capture: Optional[list[int]] = None
    slots: list[Any] = field(default_factory=list)   # terms.Match per slot

    def to_json(self) -> dict[str, Any]:
        res = dict(self.resolved or {})
        res.pop("request", None)
        return {"variant": self.variant.label, "resolved": res or None, "refused": self.refused,
                "layers_to_capture": self.layers_to_capture,
                "slots": [m.to_json() for m in self.slots]}


def run(pool, job: dict[str, Any], variants: Sequence[Variant], terms: dict, hidden: int) -> tuple[str, list[Served]]:
    """Run ``variants`` on the pool's rank (``job``: checkpoint, target, prompts,
    attention, setup, deepstack) and map each slot against ``terms`` (transformers' on
    the same shrunk checkpoint). Returns (the served dtype, one Served per variant)."""
    from harness.doctor.terms import match, split_slots

    result = pool.run(TASK, {**job, "variants": [v.job() for v in variants]})[0]
    served = []
    for variant, entry in zip(variants, result["variants"]):
        s = Served(variant, entry.get("resolved"), entry.get("refused"), entry.get("layers_to_capture"))
        if entry.get("aux") is not None:
            s.slots = [match(slot, terms) for slot in split_slots(entry["aux"], hidden)]
        served.append(s)
    return result["dtype"], served
