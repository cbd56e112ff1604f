"""The capturing model families that transformers implements, one :class:`Family` each.

A family says how to make a tiny transformers checkpoint of it (config class, fields,
model class), where transformers keeps its final norm (for the ``pre_norm`` last-layer
reference), which model spec of the stand-in suites it corresponds to (the survey's
bugs and their patches, ``harness.standins.models``), and whether its layers defer
their all-reduce (then the FlashInfer fusion emulation runs at TP > 1).

One module per family group; each exposes ``FAMILIES``. :func:`families` finds them.
Stdlib-only at import time (transformers is imported when a checkpoint is made).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Mapping, Optional

__all__ = ["Family", "families", "BOTH_BASES", "tiny_fields", "MLA_LATENT", "LONG_WINDOW",
           "PIN", "idle_stops", "IDLE_ROPE", "IDLE_MOE"]

BOTH_BASES = ("0.5.13.post1", "0.5.23")
PIN = BOTH_BASES[0]


def idle_stops(where: Mapping[str, str]) -> dict[str, str]:
    """``Family.cannot_run`` entries for the idle forward: {base label: why}."""
    return {f"{base}:idle": why for base, why in where.items()}


# Where SGLang's CPU paths stop an idle batch (no tokens): each reshapes a token dimension
# of zero with a -1 beside it ("cannot reshape tensor of 0 elements").
# * The families whose attention has no early return for an empty batch (qwen3.py's,
#   gemma3_causal.py's and the DP-attention models' do) reach the rotary embedding's
#   CPU path, RotaryEmbedding.forward_native: query.view(num_tokens, -1, head_size).
IDLE_ROPE = idle_stops({
    PIN: "an idle batch stops in SGLang's CPU rotary embedding: forward_native views the "
         "query as [0, -1, head_size] (layers/rotary_embedding/base.py:237)",
    "0.5.23": "an idle batch stops in SGLang's CPU rotary embedding: forward_native views "
              "the query as [0, -1, head_size] (layers/rotary_embedding/base.py:347)",
})
# * The MoE families reach SGLang's CPU MoE, moe_forward_native: its output
#   new_x.view(*topk_ids.shape, -1).
IDLE_MOE = idle_stops({
    PIN: "an idle batch stops in SGLang's CPU MoE: moe_forward_native views its output as "
         "[0, top_k, -1] (layers/moe/fused_moe_native.py:141)",
    "0.5.23": "an idle batch stops in SGLang's CPU MoE: moe_forward_native views its "
              "output as [0, top_k, -1] (layers/moe/fused_moe_native.py:158)",
})


# The latent widths of the tiny MLA models (DeepSeek-V3, GLM-4.7-Flash, LongCat-Flash):
# half of the released 512 + 64. SGLang's triton MLA decode kernel takes the released
# widths only (``decode_attention_fwd_grouped``: pin
# ``layers/attention/triton_ops/decode_attention.py:453-458``, 0.5.23
# ``kernels/ops/attention/decode_attention.py:826-831``, ``Lk`` 576 or 288), so the
# decode batch of a smaller latent fails in the interpreter ("incompatible dimensions").
# transformers' MLA rotary embedding is sized by ``head_dim``: the rope part's width.
MLA_LATENT = dict(kv_lora_rank=256, qk_rope_head_dim=32, head_dim=32)


# A sliding window longer than every request's whole sequence (the longest prompt, 7
# tokens, then the decode token and the verify chain: 11), for the families that check
# their captures with the windowed layers' masking left out (their ``*_window`` twins
# keep a short window).
LONG_WINDOW = 16


def tiny_fields(**fields: Any) -> dict[str, Any]:
    """The shared tiny sizes of a parity checkpoint, then ``fields``.

    Weights come from transformers' own initialisation with ``initializer_range`` 0.2
    (every layer then moves the stream visibly, so an off-by-one layer or a lost
    addend shows far above float32 noise); float32 throughout.
    """
    base: dict[str, Any] = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    base.update(fields)
    return base


@dataclasses.dataclass(frozen=True)
class Family:
    """One capturing model family, as transformers and SGLang each implement it."""

    name: str  # test id, e.g. "llama"
    sglang_file: str  # the pin's model file that captures (docs/MODELS.md row)
    hf_config_class: str  # transformers config class, e.g. "LlamaConfig"
    hf_model_class: str  # transformers model class, e.g. "LlamaForCausalLM"
    config: Callable[[], dict]  # the config class's keyword arguments (tiny)
    # The stand-in suites' model spec (harness.standins.models) of the same forward: the
    # survey's bugs (``pin_bugs``) and the patch that fixes each on the active base.
    spec: str = ""
    # Survey bugs (letters of ``ModelSpec.pin_bugs``) that only this family's parity
    # path exercises, beyond the ones every family's does (A, C, R, U, N): e.g. "L" when
    # captures go through a wrapper's setter that sets the language model's list alone.
    also_exercises: frozenset = frozenset()
    # The same, on one base only ({base label: letters}): a path that the base's own code
    # changed (e.g. a wrapper's setter that calls the model's own on a newer release).
    also_exercises_on: Mapping[str, frozenset] = dataclasses.field(default_factory=dict)
    # Its decoder layers can defer the MLP all-reduce into the next layer's fused norm:
    # at TP > 1 the FlashInfer fusion emulation runs too, fused and declined.
    defers: bool = False
    # transformers' final norm module (its input is the pre-norm last-layer stream).
    hf_final_norm: str = "model.norm"
    # Fields SGLang reads that transformers' config does not write (config.json).
    config_json: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # After transformers' init and the common perturbation of every 1-D tensor
    # (harness.parity.reference.perturb), before save_pretrained: e.g. a value a
    # checkpoint must hold in another dtype, or a layout.
    prepare: Optional[Callable[[Any], None]] = None
    # SGLang's attention backend on the CPU: torch_native, or triton (interpreted) where
    # torch_native lacks the family's path (MLA prefill, attention sinks), or
    # "module:function" building the family's own pools and backend
    # (harness.parity.runner.Requests). Verify batches run the triton backend.
    attention: str = "torch_native"
    # "module:function" run once in each rank before the family's first model is built:
    # installs CPU versions of kernels that have no CPU path (harness/standins/cpu_kernels).
    setup: str = ""
    bases: tuple = BOTH_BASES
    # It has an EAGLE3 setter. False: DFlash only (``set_dflash_layers_to_capture``; the
    # model runner refuses EAGLE3 for it), so no eagle3 or post_norm (EAGLE3 ids) set.
    eagle3: bool = True
    tps: tuple = (1, 2)
    # Absolute/relative tolerance of float32 comparisons against transformers.
    atol: float = 2e-4
    rtol: float = 2e-4
    note: str = ""
    # "<base label>" or "<base label>:tp<N>" -> why SGLang disagrees with transformers
    # there, for a genuine SGLang bug outside the captures that no patch of that base's
    # series fixes: those cases are strict expected failures (an XPASS fails: the bug is
    # gone, drop the entry) and guard nothing. docs/MODELS.md lists each. A key may end
    # in ":<mode>" (harness.parity.runner.MODES) for a bug that only a later forward
    # shows; the entries without one apply to the decode and verify forwards too (not to
    # the idle one, which holds no values to disagree on).
    known_failures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # "<base label>:<mode>" -> where SGLang's code, on the CPU, stops a later forward of
    # the family (SGLang's file:line): those cases are strict expected failures too.
    cannot_run: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def fusions(self, tp: int) -> tuple:
        """The fusion modes (``harness.standins.kernels.fusion_mode``) at ``tp``."""
        return ("off", "flashinfer") if self.defers and tp > 1 else ("off",)

    def variants(self, tp: int) -> tuple:
        """The aliasing variants (``harness.parity.runner.VARIANTS``) its cases run in at
        ``tp``: "off" everywhere (TP 1 has no all-reduce); at TP > 1 CUDA's out-of-place
        custom all-reduce ("custom_ar") too, and where the layers defer their
        all-reduce FlashInfer's fusion, fused and declined."""
        if tp <= 1:
            return ("off",)
        return ("off", "custom_ar") + (("flashinfer", "declined") if self.defers else ())


_FAMILIES: Optional[dict[str, Family]] = None


def families() -> dict[str, Family]:
    """Every :class:`Family`, by name."""
    global _FAMILIES
    if _FAMILIES is None:
        found: dict[str, Family] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            mod = importlib.import_module(f"{__name__}.{info.name}")
            for fam in getattr(mod, "FAMILIES", []):
                if fam.name in found:
                    raise ValueError(f"two parity families named {fam.name!r}")
                found[fam.name] = fam
        _FAMILIES = found
    return _FAMILIES
