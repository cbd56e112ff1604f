"""The return-aux tier: the features SGLang 0.5.23 hands a draft trainer, against transformers.

SGLang 0.5.23's ``--enable-return-aux-hidden-states`` captures on the target with no
draft (``speculative_algorithm="EAGLE3"`` only names the id convention and is reset to
None, ``arg_groups/validation_hook.py`` ``handle_aux_hidden_state_capture``), and a
request with ``return_hidden_states`` gets the K captures of every token it computed in
``meta_info["hidden_states"]``: one list of rows per prefill, then one row per generated
token but the last, each ``K * H`` wide (``managers/scheduler_components/
batch_result_processor.py`` ``_append_prefill_hidden_states`` /
``_append_decode_hidden_states``). That is how draft trainers make their data.

Per family, one Engine per configuration (``FeatureCase``: the family, the last layer's
side of the final norm, the TP size), with the radix cache on and
``chunked_prefill_size = CHUNK``, is sent (``Requests``):

1. ``MIXED``, one batch of prompts of different lengths that fits one extend forward;
2. ``CHUNKED`` alone, longer than ``CHUNK``: its prefill runs in several chunks;
3. ``CACHED`` alone, whose first ``SHARED`` tokens are a prefix of ``MIXED[0]`` (in the
   radix cache by then).

The expected value of a row is what transformers computes on the request's whole token
sequence (prompt, then every generated token but the last): id ``j`` of the EAGLE3
convention is ``hidden_states[j + 1]``, the stream entering layer ``j + 1``; the last
layer's (id ``L - 1``) is the stream entering the final norm under ``pre_norm`` and
``hidden_states[L]`` (the final norm's output) under ``post_norm``
(``--speculative-final-layer-capture``, added by the series' ``final-layer-capture``).

The checkpoints are the parity tier's own (``harness.parity.reference.make_checkpoint``
of the family: the same configs, model classes and common perturbation step, every 1-D
tensor moved off transformers' initialisation: norm weights, biases, router correction
biases), so a capture on the wrong side of a norm, a norm weight that failed to load or a
lost bias changes the value.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from harness.e2e.engine import EngineConfig, EngineError, Session

CHUNK = 8                 # chunked_prefill_size: CHUNKED runs in three chunks
MIXED_LENGTHS = (5, 3)    # one extend forward of CHUNK tokens
CHUNKED_LENGTH = 19       # chunks of 8, 8, 3
SHARED = 4                # CACHED's prefix of MIXED[0]
CACHED_TAIL = 3
MAX_NEW_TOKENS = 4        # three decode rows per request
PROMPT_TOKENS = (3, 140)  # ids drawn from [3, 140): no special or multimodal token ids
SAMPLING = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
CAPTURES = ("pre_norm", "post_norm")
# The server argument that selects the last layer's side (patch final-layer-capture).
FINAL_LAYER_CAPTURE = "final-layer-capture"


# What a family's parity checkpoint changes to run in the Engine, and why.
# deepseek_v3: SGLang's Triton MLA decode kernel takes kv_lora_rank 256 with a RoPE
# head of 32 (decode_attention.py's size check; the parity tier runs no decode);
# transformers sizes its RoPE by head_dim.
# gpt_oss: a sliding window longer than every request's whole sequence (the chunked
# prompt and its generated tokens: 23), so the decode rows are checked: SGLang's triton
# decode windows one key fewer than its extend (TRITON_DECODE_WINDOW below; the parity
# tier's gpt_oss_window keeps a short window and xfails its decode and verify forwards).
CONFIG_FIELDS: dict[str, dict[str, Any]] = {
    "gpt_oss": {"sliding_window": 64},
    "deepseek_v3": {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "head_dim": 32},
    "glm4_moe_lite": {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "head_dim": 32},
    "longcat_flash": {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "head_dim": 32},
}
# Engine arguments a family needs on this CPU, and why.
# gpt_oss: with moe_runner_backend "auto", 0.5.23's GPT-OSS override picks the
# triton_kernels MoE whenever the package imports and the CPU lacks AMX
# (arg_groups/model_overrides/gpt_oss.py:102-119), whose transposed expert layout
# then fails to load an unquantized checkpoint (fused_moe_triton/layer.py:969, "size
# of tensor a (64) must match the size of tensor b (32)"); "triton" keeps the CPU's
# own MoE path, the one the parity tier runs.
# llama4: its attention_chunk_size (8192, longer than every prompt, as in the parity
# tier) makes the model runner size a hybrid SWA pool whose admission floor is 8193
# tokens ("SWA pool cannot hold even one request"); one full pool serves it.
# qwen3_next: the radix cache of a Mamba model needs extra_buffer, which SGLang allows
# on cuda, musa, npu, hip and xpu only (arg_groups/mamba_hook.py:101-121); no_buffer
# (no prefix cache for it) needs the overlap schedule off.
# lfm2, lfm2_moe: SGLang refuses the triton backend for them (arg_groups/model_hook.py:
# 719, "the first layer might not be an attention layer"), so torch_native for their
# attention layers; their short-convolution caches are Mamba-style caches, whose radix
# cache needs what qwen3_next's does (below).
_SHORT_CONV = {"attention_backend": "torch_native", "mamba_radix_cache_strategy": "no_buffer",
               "disable_overlap_schedule": True}
ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "gpt_oss": {"moe_runner_backend": "triton"},
    "lfm2": _SHORT_CONV,
    "lfm2_moe": _SHORT_CONV,
    # qwen3_5: a hybrid GDN model with qwen3_next's radix settings; qwen3_vl*: the parity
    # family's torch_native (its tower defaults to sdpa on the CPU, layers/attention/
    # vision.py:1324-1329).
    "qwen3_5": {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True},
    "llama4": {"disable_hybrid_swa_memory": True},
    "qwen3_next": {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True},
}
# Families whose Engine here has no prefix cache (ENGINE_ARGS), and why.
_NO_MAMBA_RADIX = ("no radix cache for a Mamba model on the CPU: SGLang allows its extra_buffer "
                   "strategy only on cuda, musa, npu, hip and xpu (arg_groups/mamba_hook.py:101-121), "
                   "and no_buffer caches no prefix")
NO_PREFIX_CACHE = {
    "qwen3_next": _NO_MAMBA_RADIX,
    "qwen3_5": _NO_MAMBA_RADIX,
    "lfm2": _NO_MAMBA_RADIX,
    "lfm2_moe": _NO_MAMBA_RADIX,
}


# The multimodal families, served with images (harness.e2e.multimodal: a tiny processor
# beside the checkpoint): their config changes, on top of the parity family's.
# qwen3_vl*: a 3-block tower, each block's features a deepstack into decoder layers 0-2,
# and Qwen's special tokens inside the vocabulary (harness.doctor.cases); qwen3_5*: the
# same tokens; gemma4: image tokens attend each other in its sliding layers
# (use_bidirectional_attention "vision", what SGLang's gemma4_mm.py does in every layer:
# see GEMMA4_IMAGE_ROWS) and a window longer than every sequence (the triton decode
# window, TRITON_DECODE_WINDOW).
MULTIMODAL = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma4")


def _multimodal_config(name: str, cfg: dict) -> dict:
    from harness.e2e.multimodal import VL_TOKENS, VL_VISION

    if name.startswith("qwen3_vl"):
        return {**cfg, "vision_config": {**cfg["vision_config"], **VL_VISION}, **VL_TOKENS}
    if name.startswith("qwen3_5"):
        return {**cfg, **VL_TOKENS}
    if name.startswith("gemma4"):
        return {**cfg, "text_config": {**cfg["text_config"], "use_bidirectional_attention": "vision",
                                       "sliding_window": 128}}
    return cfg


def family(name: str):
    """The parity tier's family ``name``, with this tier's ``CONFIG_FIELDS`` (and, for a
    multimodal family, ``_multimodal_config``)."""
    from harness.parity.families import families

    fam = families()[name]
    fields = CONFIG_FIELDS.get(name)
    if fields or name in MULTIMODAL:
        fam = dataclasses.replace(fam, config=lambda: _multimodal_config(
            name, {**families()[name].config(), **(fields or {})}))
    return fam


@dataclass(frozen=True)
class FeatureCase:
    """One Engine of the tier."""

    family: str
    capture: str = "pre_norm"  # the last layer's side of the final norm
    tp: int = 1
    # The id convention --speculative-algorithm names: EAGLE3 (the model's EAGLE3 setter),
    # DFLASH (its DFlash setter) or DSPARK (its DSpark setter, else its DFlash one:
    # configure_aux_hidden_state_capture with is_dspark); all read id j as
    # hidden_states[j + 1].
    method: str = "EAGLE3"
    # --speculative-deepstack-capture (Qwen3-VL): None leaves it unset (the base's
    # default: post_deepstack on 0.5.23).
    deepstack: Optional[str] = None

    @property
    def key(self) -> str:
        method = "" if self.method == "EAGLE3" else f"-{self.method.lower()}"
        deep = f"-{self.deepstack}" if self.deepstack else ""
        return f"{self.family}{method}-{self.capture}{deep}" + (f"-tp{self.tp}" if self.tp > 1 else "")

    @property
    def multimodal(self) -> bool:
        return self.family in MULTIMODAL

    @property
    def attention(self) -> str:
        """SGLang's own backend: torch_native, or triton (interpreted) where the parity
        family needs more than torch_native has (MLA prefill, attention sinks)."""
        return "torch_native" if family(self.family).attention == "torch_native" else "triton"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    layers: int
    hidden: int
    model: Any = field(compare=False, repr=False)  # the transformers model (float32, eval)
    perturbed: tuple[str, ...] = ()
    image: Optional[Path] = None   # a multimodal family's requests' image


def make_checkpoint(family_name: str, directory: Path) -> Checkpoint:
    """The parity family's tiny checkpoint, every 1-D tensor perturbed (the parity tier's
    common step, ``harness.parity.reference.perturb``); the transformers model kept for
    the reference."""
    from harness.parity import reference

    model = reference.make_checkpoint(family(family_name), directory)
    image = None
    if family_name in MULTIMODAL:
        from harness.e2e import multimodal

        multimodal.save_processor(family_name, directory)
        image = multimodal.save_image(directory / "image.png")
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    # NemotronH counts its layers by their block types.
    layers = (config.get("num_hidden_layers") or text.get("num_hidden_layers")
              or len(text.get("layers_block_type") or ()))
    perturbed = tuple(reference.one_dimensional(model))
    return Checkpoint(directory, int(layers), int(text["hidden_size"]), model, perturbed, image)


def layer_ids(layers: int) -> tuple[int, ...]:
    """EAGLE3 ids: the first capture after layer 1 (id 1: deepseek_v2's setter adds the
    convention's 1 only when the first id is 1, ``deepseek_v2.py:3492``), one in the
    middle and the last layer's (``L - 1``)."""
    return (1, layers // 2, layers - 1) if layers > 3 else (0, 1, layers - 1)


def requests(seed: int = 3, image: Sequence[int] = (), chunked_image: bool = True) -> dict[str, list[list[int]]]:
    """The prompts of each stage, by name (token ids). ``image``: a multimodal family's
    placeholder of one image, put into the first mixed prompt after its first
    ``SHARED`` tokens (so the cached prompt shares text alone with it) and, with
    ``chunked_image``, into the chunked prompt (whose image then spans a chunk boundary)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(*PROMPT_TOKENS, (n,), generator=gen).tolist()

    mixed = [draw(n) for n in MIXED_LENGTHS]
    chunked = [draw(CHUNKED_LENGTH)]
    cached = [mixed[0][:SHARED] + draw(CACHED_TAIL)]
    if image:
        mixed[0] = mixed[0][:SHARED] + list(image) + mixed[0][SHARED:]
        if chunked_image:
            chunked[0] = chunked[0][:CHUNK - 2] + list(image) + chunked[0][CHUNK - 2:]
    return {"mixed": mixed, "chunked": chunked, "cached": cached}


def has_image(prompt: Sequence[int], image: Sequence[int]) -> bool:
    n = len(image)
    return bool(image) and any(list(prompt[i:i + n]) == list(image) for i in range(len(prompt) - n + 1))


def engine_config(case: FeatureCase, ckpt: Checkpoint) -> EngineConfig:
    extra: dict[str, Any] = dict(
        enable_return_aux_hidden_states=True,
        speculative_algorithm=case.method,  # the id convention only (reset to None)
        return_aux_hidden_state_layer_ids=list(layer_ids(ckpt.layers)),
        attention_backend=case.attention,
        disable_radix_cache=False,
        chunked_prefill_size=CHUNK,
        skip_tokenizer_init=True,
    )
    if case.capture != "pre_norm":
        extra["speculative_final_layer_capture"] = case.capture
    if case.deepstack:
        extra["speculative_deepstack_capture"] = case.deepstack
    env: dict[str, str] = {}
    if case.tp > 1:
        extra["tp_size"] = case.tp
        # SGLang's CPU engine binds each rank to cores of its own, and without this
        # refuses more ranks than NUMA nodes (one here): a core each, or all shared.
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            str(r % cores) if cores >= case.tp else f"0-{cores - 1}" for r in range(case.tp))
    extra.update(ENGINE_ARGS.get(case.family, {}))
    setup = family(case.family).setup
    return EngineConfig(key=case.key, model=case.family, target=str(ckpt.path), extra=tuple(extra.items()),
                        setup=(setup,) if setup else (), env=tuple(env.items()))


@dataclass
class Request:
    stage: str
    prompt: list[int]
    output_ids: list[int]
    rows: Any          # torch.Tensor [n, K*H]: what SGLang returned, in order
    meta: dict[str, Any]
    # RAW_CASES: the same request sent again asking for one tensor
    # (return_raw_hidden_states), or the error that got instead; and its output ids.
    raw: Any = None
    raw_output_ids: Optional[list[int]] = None
    # A request with an image: the ids sent (one placeholder; ``prompt`` is what SGLang
    # ran, the placeholder expanded) and what transformers takes for the prompt (its
    # processor's output: the expanded ids, pixel values, ...).
    sent: Optional[list[int]] = None
    hf_inputs: Optional[dict[str, Any]] = field(default=None, repr=False)

    @property
    def sequence(self) -> list[int]:
        """The tokens whose rows a trainer gets: the prompt, then every generated token but
        the last (which no forward has taken as input)."""
        return self.prompt + self.output_ids[:-1]


def rows_of(hidden_states: Sequence[Any]) -> Any:
    """``meta_info["hidden_states"]`` as one ``[n, K*H]`` float32 tensor: each prefill
    appends a list of rows, each decode step one row."""
    import torch

    from harness.e2e.driver import flat_rows

    return torch.tensor(flat_rows(hidden_states), dtype=torch.float32)


@dataclass
class FeatureRun:
    case: FeatureCase
    ckpt: Checkpoint
    requests: list[Request]
    _expected: dict[int, Any] = field(default_factory=dict, repr=False)

    def stage(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.stage == name]

    def expected(self, req: Request) -> Any:
        """transformers' rows for the whole of ``req.sequence`` (``expected_rows``)."""
        key = id(req)
        if key not in self._expected:
            self._expected[key] = expected_rows(self.ckpt, self.case.family, req.sequence, self.case.capture,
                                                req.hf_inputs, self.case.deepstack)
        return self._expected[key]


def compare(got: Any, want: Any, run: FeatureRun) -> str | None:
    """``compare_rows`` with the run's slots and its family's float32 tolerance."""
    fam = family(run.case.family)
    return compare_rows(got, want, run.ckpt.hidden, slot_names(layer_ids(run.ckpt.layers), run.ckpt.layers),
                        fam.atol, fam.rtol)


def slot_names(ids: Sequence[int], layers: int) -> list[str]:
    """What each slot of a row holds, for messages."""
    return ["the last layer's" if j == layers - 1 else f"id {j}'s" for j in ids]


def compare_rows(got: Any, want: Any, hidden: int, slots: Sequence[str], atol: float, rtol: float) -> str | None:
    """None when ``got`` equals ``want`` (whole ``[n, K*H]`` tensors) within
    ``atol + rtol * |row|`` per slot of a row (``|row|``: the largest magnitude in
    transformers' slot: rounding scales with the stream, and some streams reach 100s);
    else what differs: the shape, or per slot the largest error and the first row out
    of tolerance."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, transformers {tuple(want.shape)}"
    parts = []
    for k, name in enumerate(slots):
        cols = slice(k * hidden, (k + 1) * hidden)
        err = (got[:, cols] - want[:, cols]).abs().amax(dim=-1)
        scale = want[:, cols].abs().amax(dim=-1)
        bad = err > atol + rtol * scale
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            parts.append(f"slot {k} ({name}): max error {float(err.max()):.3g} (|ref| "
                         f"{float(scale.max()):.3g}), first bad row {row}")
    return "; ".join(parts) or None


# The base's deepstack_capture when the server leaves it unset (docs/MODELS.md, "Qwen3-VL
# deepstack captures"): 0.5.23's inference path, post_deepstack.
DEEPSTACK_DEFAULT = "post_deepstack"
# The decoder layers whose output takes a deepstack feature (the tiny tower's three).
DEEPSTACK_LAYERS = 3


def expected_rows(ckpt: Checkpoint, family_name: str, sequence: Sequence[int], capture: str,
                  inputs: Optional[dict[str, Any]] = None, deepstack: Optional[str] = None) -> Any:
    """transformers' ``[len(sequence), K*H]`` for ``sequence`` under the EAGLE3 ids of
    ``layer_ids`` (``hf_rows``). ``inputs``: the processor's output for a prompt with an
    image (``sequence`` then holds its expanded ids); on Qwen3-VL the captures next to a
    deepstack addition are taken after it under ``post_deepstack`` (``deepstack``, or
    the base's default when unset)."""
    post = (family_name.startswith("qwen3_vl") and (deepstack or DEEPSTACK_DEFAULT) == "post_deepstack")
    return hf_rows(ckpt.model, sequence, [j + 1 for j in layer_ids(ckpt.layers)], ckpt.layers, capture,
                   family(family_name).hf_final_norm, inputs=inputs,
                   entering=range(1, DEEPSTACK_LAYERS + 1) if post else ())


def hf_rows(model, sequence: Sequence[int], indices: Sequence[int], layers: int, capture: str,
            final_norm: str = "model.norm", *, inputs: Optional[dict[str, Any]] = None,
            entering: Sequence[int] = ()) -> Any:
    """transformers' captures of ``sequence``, ``[len(sequence), K*H]``: per capture index
    ``i`` (EAGLE3 id ``j`` is ``i = j + 1``), ``hidden_states[i]``, the stream entering
    layer ``i``, except ``i == layers`` (the last layer's output) under ``pre_norm``: the
    stream entering the final norm (a pre-hook on ``final_norm``, transformers' module
    path), not ``hidden_states[L]``, which is after it (``post_norm``).

    ``inputs``: a multimodal prompt's processor output (its ``input_ids`` the prompt's
    part of ``sequence``; the generated tokens are appended as text). ``entering``: the
    indices whose value is the stream entering decoder layer ``i`` (a forward pre-hook),
    Qwen3-VL's ``post_deepstack``: ``hidden_states[i]`` plus the deepstack feature of
    layer ``i - 1`` on image rows (transformers 5 records a layer's output before it)."""
    import functools

    import torch

    norm = functools.reduce(getattr, final_norm.split("."), model)
    decoder = functools.reduce(getattr, final_norm.rsplit(".", 1)[0].split("."), model).layers
    seen: list = []
    streams: dict[int, Any] = {}

    def take(i):
        def hook(_m, args, kwargs):
            streams[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    handles = [norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))]
    handles += [decoder[i].register_forward_pre_hook(take(i), with_kwargs=True) for i in entering]
    kwargs: dict[str, Any] = {}
    ids = torch.tensor([list(sequence)])
    if inputs is not None:
        prompt = inputs["input_ids"].shape[1]
        if list(sequence[:prompt]) != inputs["input_ids"][0].tolist():
            raise RuntimeError("the sequence does not start with the processor's prompt ids")
        kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "mm_token_type_ids")}
        if "mm_token_type_ids" in inputs:  # the generated tokens are text
            types = inputs["mm_token_type_ids"]
            kwargs["mm_token_type_ids"] = torch.cat(
                [types, torch.zeros(1, len(sequence) - prompt, dtype=types.dtype)], dim=1)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if len(seen) != 1:
        raise RuntimeError(f"transformers' {final_norm} ran {len(seen)} times")
    hidden = [h[0] for h in out.hidden_states]
    slots = [seen[0][0] if i == layers and capture == "pre_norm" else streams[i][0] if i in streams
             else hidden[i] for i in indices]
    return torch.cat(slots, dim=-1)


class FeatureRuns:
    """Each configuration run once, through the tier's driver session."""

    def __init__(self, session: Session, root: Path) -> None:
        self.session = session
        self.root = root
        self._ckpts: dict[str, Checkpoint] = {}
        self._runs: dict[FeatureCase, FeatureRun | EngineError] = {}

    def checkpoint(self, family: str) -> Checkpoint:
        if family not in self._ckpts:
            self._ckpts[family] = make_checkpoint(family, self.root / family)
        return self._ckpts[family]

    def get(self, case: FeatureCase) -> FeatureRun:
        if case not in self._runs:
            self._runs[case] = self._run(case)
        got = self._runs[case]
        if isinstance(got, EngineError):
            raise got
        return got

    def _run(self, case: FeatureCase) -> FeatureRun | EngineError:
        ckpt = self.checkpoint(case.family)
        out: list[Request] = []
        placeholder = ()
        if case.multimodal:
            from harness.e2e import multimodal

            placeholder = multimodal.placeholder(case.family)
        try:
            self.session.ensure(engine_config(case, ckpt))
            chunked_image = case.family not in CHUNKED_TEXT_ONLY
            for stage, prompts in requests(image=placeholder, chunked_image=chunked_image).items():
                images = [str(ckpt.image) if has_image(p, placeholder) else None for p in prompts]
                got = self.session.generate(None, SAMPLING, input_ids=prompts, return_hidden_states=True,
                                            image_data=images if any(images) else None)
                if len(got) != len(prompts):
                    raise EngineError(f"{case.key}: {len(prompts)} requests of stage {stage} gave {len(got)} outputs")
                for prompt, image, o in zip(prompts, images, got):
                    req = Request(stage, prompt, o["output_ids"], rows_of(o.get("hidden_states")), o["meta"])
                    if image is not None:
                        req.sent, req.hf_inputs = prompt, multimodal.hf_inputs(ckpt.path, prompt, ckpt.image)
                        req.prompt = req.hf_inputs["input_ids"][0].tolist()
                    out.append(req)
            if case in RAW_CASES:
                self._raw_pass(out)
        except EngineError as exc:
            return exc
        return FeatureRun(case, ckpt, out)

    def _raw_pass(self, out: list[Request]) -> None:
        """The stages again, from an empty radix cache (so each forward is the one the
        list pass ran), asking for one tensor per request (``return_raw_hidden_states``)."""
        from harness.e2e.driver import raw_tensor

        self.session.flush()
        pending = iter(out)
        for stage, prompts in requests().items():
            try:
                got = self.session.generate(None, SAMPLING, input_ids=prompts, raw_hidden_states=True)
            except EngineError as exc:  # the Engine refused the argument: each test says so
                for _ in prompts:
                    next(pending).raw = exc
                continue
            for o in got:
                req = next(pending)
                req.raw_output_ids = o["output_ids"]
                try:
                    req.raw = raw_tensor(o.get("hidden_states_raw") or {})
                except ValueError as exc:
                    req.raw = exc


# ---------------------------------------------------------------- what runs, what fails

# The triton backend's decode window holds one token fewer than its extend window.
TRITON_DECODE_WINDOW = (
    "SGLang 0.5.23's triton attention backend attends sliding_window_size + 1 tokens in "
    "extend (kernels/ops/attention/extend_attention.py:563-568, kv >= q - window) but "
    "min(seq_len, sliding_window_size) in decode (layers/attention/triton_backend.py:2869-2872, "
    "update_sliding_window_buffer); gpt_oss.py:134-135 passes sliding_window - 1, so a decode "
    "token of a sliding layer sees sliding_window - 1 tokens where transformers (and the "
    "prefill) see sliding_window. Passing sliding_window_size + 1 there makes every decode "
    "row match")

# (family, rows) -> why SGLang disagrees with transformers there; rows: "prompt",
# "generated", "chunked", "cached". Strict xfails that guard nothing. None today: gpt_oss
# runs with a window longer than its sequences (CONFIG_FIELDS), where TRITON_DECODE_WINDOW
# cannot show; the parity tier's gpt_oss_window keeps that bug as its strict xfail.
GEMMA4_IMAGE_ROWS = (
    "SGLang 0.5.23's Gemma 4 attends image tokens otherwise than transformers: "
    "gemma4_mm.py prepare_attn_masks (333-466) makes image tokens bidirectional in every layer "
    "whatever use_bidirectional_attention says (transformers: only under \"vision\" and only in "
    "sliding layers, modeling_gemma4.py:2072-2132), and the causal triton extend kernel stops each "
    "query block's key loop at its own end (kernels/ops/attention/extend_attention.py:719-723), "
    "cutting that mask; its vision encoder pools padding patches into soft token 0 "
    "(gemma4_mm.py:202 builds Gemma4VisionEncoder without mask_pad_before_pool). Rows at and "
    "after an image differ; text-only requests match")
KNOWN: dict[tuple[str, str], str] = {
    ("gemma4", "prompt"): GEMMA4_IMAGE_ROWS,
    ("gemma4", "generated"): GEMMA4_IMAGE_ROWS,
    ("gemma4", "chunked"): GEMMA4_IMAGE_ROWS,
}


def known_failure(case: FeatureCase, rows: str) -> str | None:
    return KNOWN.get((case.family, rows))


# Every family SGLang 0.5.23's CPU engine serves here (docs/MODELS.md, "The return-aux
# tier", lists the others and why each does not run), pre_norm, and post_norm for
# POST_NORM_FAMILIES; TP 2 for
# llama and three families whose layers defer their all-reduce (gloo: no fusion on the
# CPU); the DFLASH
# convention (0.5.23 refuses DFLASH decoding on the CPU, but capture-only resets the
# algorithm first) for three families with a DFlash setter of their own, and DSPARK's
# once (DSPARK_CASES).
FAMILIES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3", "glm4_moe",
    "apertus", "arcee", "glm4", "gemma3_mm", "glm4_moe_lite", "minimax_m2", "longcat_flash",
    "llama4", "qwen2_moe", "qwen3_next",
)
# post_norm on a subset, for the budget (make e2e <= 6 min on 2 cores): the families
# the issue names and qwen3_next (its own final-norm path). A model's post_norm is the
# same two lines after its layer loop in every forward mode (final-layer-capture), and
# the parity tier checks it for every family at TP 1 and 2 against transformers.
POST_NORM_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3",
                      "glm4_moe", "qwen3_next")
TP2_FAMILIES = ("llama", "qwen3_moe", "deepseek_v3", "glm4_moe")
DFLASH_FAMILIES = ("llama", "qwen3_moe", "gpt_oss")
# The families with a DFlash setter only (the model runner refuses EAGLE3 for them), in
# the DFLASH convention alone.
DFLASH_ONLY_FAMILIES = ("laguna", "lfm2", "lfm2_moe")
# The DSPARK convention once, with post_norm (the capture-only path resolves it from the
# server argument with is_dspark set; no served family has a DSpark setter of its own).
DSPARK_CASES = (FeatureCase("llama", "post_norm", method="DSPARK"),)
# The multimodal families, each request of their mixed batch and their chunked prompt
# with an image: Qwen3-VL with the server's deepstack_capture on either side (through the
# model runner to the model, patch qwen3-vl-deepstack-capture), its MoE with the base's
# default, Qwen3.5 and Gemma 4.
MULTIMODAL_CASES = (FeatureCase("qwen3_vl", deepstack="pre_deepstack"),
                    FeatureCase("qwen3_vl", deepstack="post_deepstack"),
                    FeatureCase("qwen3_vl_moe"), FeatureCase("qwen3_5"), FeatureCase("gemma4"))
# Multimodal families whose chunked prompt is text only, and why.
CHUNKED_TEXT_ONLY = {
    "qwen3_5": "a Qwen3.5 prompt whose image spans a chunked-prefill boundary stops the scheduler in "
               "the GDN prefill convolution: gdn_backend.py _convolve_prefill (929-940) hands "
               "causal_conv1d_fwd_cpu mixed_qkv.transpose(0, 1), which is not [dim, tokens] transposed "
               "there (the op's check, kept by the CPU stand-in: \"expect x to be transposed\"); the same "
               "prompt without the image, and the image in an unchunked prompt, run",
}
# The patch that adds --speculative-deepstack-capture (0.5.23).
DEEPSTACK_CAPTURE = "qwen3-vl-deepstack-capture"
# The configurations whose requests are sent twice, the second time asking for one tensor
# per request (return_raw_hidden_states, patch return-hidden-states-arrays): both sides
# of the final norm, each stage (mixed batch, chunked prompt, cached prefix). The raw form
# is the same rows in another container: what a model or TP size changes is in the rows,
# which the list form's checks cover for every configuration.
RAW_CASES = (FeatureCase("llama", "pre_norm"), FeatureCase("llama", "post_norm"))
# The patch that keeps hidden states as arrays to the caller.
RAW_HIDDEN_STATES = "return-hidden-states-arrays"
FEATURE_CASES = tuple(
    [FeatureCase(f, capture) for f in FAMILIES for capture in CAPTURES
     if capture == "pre_norm" or f in POST_NORM_FAMILIES]
    + [FeatureCase(f, "pre_norm", tp=2) for f in TP2_FAMILIES]
    + [FeatureCase(f, "pre_norm", method="DFLASH") for f in DFLASH_FAMILIES + DFLASH_ONLY_FAMILIES]
    + list(DSPARK_CASES)
    + list(MULTIMODAL_CASES)
)
