"""The capturing models of the pin, each a tiny real SGLang model with CPU stand-ins.

One module per model family; each exposes ``SPECS``, a list of :class:`ModelSpec`.
A spec says how to build the model's real ``XModel`` (its module, class and config),
which module-level names of that module are GPU compute that stands in (attention,
MLP/MoE, and how each finishes its partial sum), and what the survey
(docs/MODELS.md) found about it at the pin. Everything else runs as SGLang's own
code: ``XModel.forward``, the decoder layers, their communicators and norms.

:func:`specs` finds every spec; :func:`build` makes the tiny model in the current
rank (SGLang's distributed state must be up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from harness.standins.blocks import REDUCE_DEFERABLE, REDUCE_NONE, REDUCE_SELF, TinyConfig

__all__ = [
    "ModelSpec",
    "specs",
    "build",
    "REDUCE_SELF",
    "REDUCE_NONE",
    "REDUCE_DEFERABLE",
    "hf_config",
]


def _set_layers_to_capture(model, indices: Sequence[int]) -> None:
    model.layers_to_capture = list(indices)


def _hidden_plus_residual(out):
    """A decoder layer's complete output: ``hidden_states + residual``."""
    if isinstance(out, tuple):
        h, r = out[0], (out[1] if len(out) > 1 else None)
        return h if r is None else h + r
    return out


def _default_construct(cls, config):
    return cls(config, quant_config=None)


def _default_run(model, input_ids, positions, forward_batch, **inputs):
    return model(input_ids, positions, forward_batch, **inputs)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How to build and drive one capturing model of the pin."""

    name: str  # e.g. "llama"; also the test id
    module: str  # "sglang.srt.models.llama"
    model_cls: str  # "LlamaModel": the class whose forward captures
    # module-level name -> (reduce mode, extra attributes) of a GPU compute stand-in
    standins: Mapping[str, tuple]
    config: Callable[[TinyConfig], Any]
    # Its decoder layers can defer the MLP all-reduce into the next layer's fused
    # norm (``_sglang_needs_allreduce_fusion``): the fusion modes apply.
    defers: bool = False
    # What the survey found at the pin: "A" capture before a deferred all-reduce,
    # "C" the last layer is never captured, "B" list + cat, "E" captures aliased by
    # later in-place norms, "F" the last layer defers its all-reduce into the final
    # norm, "T" two-batch overlap drops captures, "X" the capture expression is not the
    # layer's output, "L" in-loop captures follow per-layer flags, not
    # layers_to_capture, "R" no DFlash setter (the model runner refuses DFlash), "U" no
    # setter at all (EAGLE3 and DFlash unreachable), "N" the final norm differs from the
    # reference, "V" deepstack lost or multiplied under a deferred all-reduce, or
    # captured before it. "G" (0.5.23) a packer model's packer is not
    # ``AuxHiddenStatePacker.for_batch`` (no shared ``aux_hidden_states_buffer``) and its
    # CausalLM has no ``get_aux_hidden_states_width``. "P" (0.5.23) the model runner
    # refuses a post_norm last-layer capture the model's loops could serve.
    pin_bugs: frozenset = frozenset()
    construct: Callable = _default_construct
    configure: Callable = _set_layers_to_capture
    layer_output: Callable = _hidden_plus_residual
    run: Callable = _default_run
    # Extra (object, attribute, value) patches while the model is built.
    build_patches: Callable[[Any], list] = lambda mod: []
    embed_attr: str = "embed_tokens"
    layers_attr: str = "layers"
    tiny: TinyConfig = TinyConfig()
    wraps: tuple = ()  # model files that delegate to this model's forward
    note: str = ""
    # Patch-Ids that fix a bug here when not the series' per-model ones (deepseek_v2).
    fixed_by: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # In tests/multirank/test_model_matrix.py (deepseek_v2 has a matrix of its own).
    in_matrix: bool = True
    # An idle batch (zero tokens) gives K of K empty captures; False where the model
    # returns none at all by design (0.5.23's lfm2 and lfm2_moe: their layers skip
    # IDLE and the CausalLM takes the bare tensor; DFlash skips idle batches).
    idle_captures: bool = True
    # The model serves the last layer's capture after the final norm (``post_norm``);
    # False where the model runner refuses post_norm at start-up (0.5.23's beam: the
    # last capture is taken inside its layer loops), so no post-norm case runs for it.
    post_norm: bool = True

    def bugs(self) -> frozenset:
        return self.pin_bugs

    def patch_for(self, bug: str, default: Optional[str] = None) -> Optional[str]:
        """The Patch-Id whose regression tests on this model guard ``bug``: the spec's
        own, else ``default``, else the active base's series-wide one (:func:`fixed_by`);
        None when that series does not fix ``bug``."""
        return self.fixed_by.get(bug, default or fixed_by().get(bug))


def hf_config(tc: TinyConfig, cls: Any = None, **fields: Any):
    """A transformers config for a tiny model: shared defaults, then ``fields``."""
    if cls is None:
        from transformers import PretrainedConfig as cls
    base: dict[str, Any] = dict(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=tc.hidden_size // 4,
        vocab_size=tc.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=256,
        hidden_act="silu",
        tie_word_embeddings=False,
        pad_token_id=0,
        attention_bias=False,
    )
    base.update(fields)
    return cls(**base)


# ---------------------------------------------------------------- registry

# The pin's series: the Patch-Id that fixes each bug of the survey (docs/MODELS.md) in
# every model whose spec names no other (``ModelSpec.fixed_by``).
FIXED_BY = {
    "A": "models-capture-after-allreduce",
    "B": "models-aux-packer",
    "C": "models-capture-final-layer",
    "E": "models-aux-packer",
    "X": "models-aux-packer",
    "F": "qwen3-next-last-layer-allreduce",
    "T": "models-capture-no-shortfall",
    "L": "models-capture-by-index",
    "R": "models-capture-setters",
    "U": "models-capture-setters",
    "N": "granite-final-norm",
    "V": "deepstack-capture",
}


def fixed_by() -> dict[str, str]:
    """The active base's bug -> Patch-Id map: :data:`FIXED_BY` on the pin, the other
    base's ``models.FIXED_BY``; a bug its series leaves alone has no entry."""
    from harness.standins import bases

    pkg = bases.package()
    if pkg is None:
        return FIXED_BY
    return importlib.import_module(pkg + ".models").FIXED_BY


_SPECS: Optional[dict[str, ModelSpec]] = None


def specs() -> dict[str, ModelSpec]:
    """Every :class:`ModelSpec` of the active base, by name: this package's on the pin,
    ``harness.standins.v<base>.models``'s on another base."""
    global _SPECS
    if _SPECS is None:
        from harness.standins import bases

        pkg_name = __name__ if bases.package() is None else bases.package() + ".models"
        pkg = importlib.import_module(pkg_name)
        found: dict[str, ModelSpec] = {}
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            mod = importlib.import_module(f"{pkg_name}.{info.name}")
            for spec in getattr(mod, "SPECS", []):
                if spec.name in found:
                    raise ValueError(f"two model specs named {spec.name!r}")
                found[spec.name] = spec
        _SPECS = found
    return _SPECS


# ---------------------------------------------------------------- building


@contextlib.contextmanager
def _patched(items: list) -> Iterator[None]:
    saved = []
    try:
        for obj, name, value in items:
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _is_norm(module) -> bool:
    return "norm" in type(module).__name__.lower()


def _fill_other_params(model, seed: int) -> None:
    """Small-integer values for real parameters that are neither stood in, embeddings,
    nor norms (routers, gates, projections): constructors leave them uninitialized."""
    import zlib

    import torch

    for mod_name, module in model.named_modules():
        if getattr(module, "auxcap_stands_in_for", None) or _is_norm(module):
            continue
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}"
            if "embed" in full:
                continue
            g = torch.Generator().manual_seed(seed * 7 + zlib.crc32(full.encode()))
            with torch.no_grad():
                param.copy_(torch.randint(-1, 2, param.shape, generator=g).to(param.dtype))


def _integer_embeddings(model, spec: ModelSpec, tc: TinyConfig, dtype) -> None:
    import torch

    from harness.standins.blocks import _full_weight

    emb = getattr(model, spec.embed_attr, None)
    if emb is None or not hasattr(emb, "weight"):
        return
    with torch.no_grad():
        full = (_full_weight(tc.seed, 999, (tc.vocab_size, tc.hidden_size)) * 3).to(emb.weight.device)
        shard = getattr(emb, "shard_indices", None)
        if shard is not None:  # VocabParallelEmbedding: this rank's vocab rows
            full = full[shard.org_vocab_start_index : shard.org_vocab_end_index]
        emb.weight.zero_()
        emb.weight[: full.shape[0]].copy_(full.to(dtype))


def build(spec: ModelSpec, tc: Optional[TinyConfig] = None):
    """SGLang's real ``spec.model_cls`` with CPU stand-ins, in this rank."""
    from harness.standins.blocks import standin_class
    from harness.standins.kernels import device, has_real_kernels, install_cpu_norm, model_dtype

    tc = tc or spec.tiny
    mod = importlib.import_module(spec.module)
    items = [
        (mod, name, standin_class(getattr(mod, name), tc, reduce, dict(attrs or {})))
        for name, (reduce, attrs) in spec.standins.items()
    ]
    items += spec.build_patches(mod)
    with _patched(items):
        config = spec.config(tc)
        model = spec.construct(getattr(mod, spec.model_cls), config)
    dtype = model_dtype(tc)
    model.to(device=device(), dtype=dtype)
    _fill_other_params(model, tc.seed)
    _integer_embeddings(model, spec, tc, dtype)
    if not has_real_kernels():
        install_cpu_norm(model)
    model.auxcap_spec = spec.name
    return model
