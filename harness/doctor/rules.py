"""What pristine SGLang of the same base, and vLLM, would feed the same draft: a table of
rules, each with the source file it was read from (stdlib only).

These readings are not run (the served mapping is, :mod:`harness.doctor.served`); they
say what the draft would get on the release the series patches and on the other
server, so a draft trained on features from either can be told apart. A slot's value is
a term of :mod:`harness.doctor.terms` (its key), or a note beginning "missing" or
"refused".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

PIN, NEWEST = "0.5.13.post1", "0.5.23"


@dataclass(frozen=True)
class Rule:
    reader: str     # "sglang-<base> (pristine)" | "vllm"
    what: str
    feeds: str
    source: str


RULES: tuple[Rule, ...] = (
    Rule("sglang", "EAGLE3, no ids in eagle_config", "layers_to_capture [2, L // 2, L - 3]: "
         "hidden_states[2], hidden_states[L // 2], hidden_states[L - 3]",
         "python/sglang/srt/models/llama.py set_eagle3_layers_to_capture (pin 817-820, 0.5.23 933-936); "
         "the model runner reads eagle_config only (pin model_runner.py:452-475, 0.5.23 "
         "model_runner_components/spec_aux_hidden_state.py:185-195)"),
    Rule("sglang", "EAGLE3 id k", "hidden_states[k + 1] (layer k's output)",
         "python/sglang/srt/models/llama.py set_eagle3_layers_to_capture: [val + 1 for val in layer_ids] "
         "(pin 822-825, 0.5.23 937-941); every capturing model's setter"),
    Rule("sglang", "EAGLE3 id k on deepseek_v2 / glm4_moe_lite", "hidden_states[k + 1] only when the first "
         "id is 1, else hidden_states[k]",
         "python/sglang/srt/models/deepseek_v2.py set_eagle3_layers_to_capture (pin 2752-2755, 0.5.23 "
         "3470-3473), glm4_moe_lite.py (pin 1034-1035); sgl-project/sglang#25454"),
    Rule("sglang", "DFlash / DSpark id j", "hidden_states[j + 1] (layer j's output)",
         "python/sglang/srt/models/llama.py set_dflash_layers_to_capture (0.5.23 943-953)"),
    Rule("sglang-0.5.13.post1", "the last layer (capture index L)", "missing: the pin captures at the top of "
         "its layer loop and never after the last layer (K-1 of K)",
         "python/sglang/srt/models/llama.py LlamaModel.forward (pin 409-410); docs/MODELS.md bug C"),
    Rule("sglang-0.5.23", "the last layer (capture index L)", "missing (K-1 of K; deepseek_v2 raises "
         "'captured K-1 of K'), except gpt_oss: pre_norm",
         "python/sglang/srt/models/*.py capture_output at layer boundaries; gpt_oss.py (sgl-project/sglang#32334)"),
    Rule("sglang", "final_layer_capture / deepstack_capture keys", "not read (no such setting before this series)",
         "python/sglang/srt/layers/aux_hidden_states.py (added by patch final-layer-capture)"),
    Rule("sglang-0.5.13.post1", "Qwen3-VL capture next to a deepstack addition", "dense qwen3_vl: pre_deepstack; "
         "qwen3_vl_moe: post_deepstack",
         "python/sglang/srt/models/qwen3_vl.py (pin 1027-1030, before prepare_attn), qwen3_vl_moe.py (pin "
         "102-105); docs/MODELS.md bug V"),
    Rule("sglang-0.5.23", "Qwen3-VL capture next to a deepstack addition", "post_deepstack (the inference path)",
         "python/sglang/srt/models/qwen3_vl.py Qwen3LLMModel.forward (0.5.23 1255-1271)"),
    Rule("sglang-0.5.23", "Gemma3 captures", "branch[i]: hidden_states alone, without the residual",
         "python/sglang/srt/models/gemma3_causal.py Gemma3TextModel.forward (0.5.23 638-672); "
         "sgl-project/sglang#39286"),
    Rule("vllm", "EAGLE3 id k", "hidden_states[k] (layer k - 1's output; k = 0 the embeddings, k = L pre_norm)",
         "vllm/model_executor/models/interfaces.py EagleModelMixin._maybe_add_hidden_state (called with "
         "layer k's input); eagle3_utils.py"),
    Rule("vllm", "EAGLE3, no ids", "(2, L // 2, L - 3): hidden_states[2], hidden_states[L // 2], "
         "hidden_states[L - 3]",
         "vllm/model_executor/models/llama.py get_eagle3_aux_hidden_state_layers"),
    Rule("vllm", "DFlash id j", "hidden_states[j + 1] (layer j's output)", "vLLM's DFlash proposer "
         "(vllm-project/vllm#40727)"),
    Rule("vllm", "residual", "hidden_states + residual", "EagleModelMixin._maybe_add_hidden_state"),
)


def _index_term(index: int, layers: int, last: str) -> str:
    if index == layers:
        return last
    if index > layers or index < 0:
        return f"missing: capture index {index} is past the last layer"
    return f"hidden_states[{index}]"


def pristine(base: str, family: str, method: str, ids: Optional[Sequence[int]], layers: int,
             sglang_file: str) -> list[str]:
    """Per slot, what pristine SGLang ``base`` feeds the draft (``ids``: what SGLang's
    model runner reads, None for EAGLE3's default)."""
    if ids is None:
        indices = [2, layers // 2, layers - 3] if method == "EAGLE3" else []
    elif method == "EAGLE3" and sglang_file in ("deepseek_v2.py", "glm4_moe_lite.py"):
        indices = [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    else:
        indices = [i + 1 for i in ids]
    if base == PIN:
        last = "missing: the pin never captures the last layer (K-1 of K)"
    elif family == "gpt_oss":
        last = "pre_norm"
    else:
        last = "missing: 0.5.23 never captures the last layer (K-1 of K), but gpt_oss"
    out = []
    for i in indices:
        term = _index_term(i, layers, last)
        if base == NEWEST and family in ("gemma3", "gemma3_mm") and term.startswith("hidden_states["):
            term = f"branch[{i}]"
        if family.startswith("qwen3_vl") and term.startswith("hidden_states[") and 1 <= i <= 3:
            post = base == NEWEST or family == "qwen3_vl_moe"
            term = f"hidden_states[{i}]+deepstack[{i - 1}]" if post else term
        out.append(term)
    return out


def vllm(method: str, ids: Optional[Sequence[int]], layers: int) -> list[str]:
    """Per slot, what vLLM feeds a draft naming ``ids`` (any key: its speculators config
    reads the top-level one)."""
    if method == "EAGLE3":
        indices = [2, layers // 2, layers - 3] if ids is None else list(ids)
    else:
        indices = [j + 1 for j in ids or ()]
    return [_index_term(i, layers, "pre_norm") for i in indices]


def table(base: str) -> list[dict[str, str]]:
    """The rules that apply to ``base`` (and vLLM's), as JSON rows."""
    keep = ("sglang", f"sglang-{base}", "vllm")
    return [{"reader": r.reader if r.reader == "vllm" else f"sglang {base} (pristine)",
             "what": r.what, "feeds": r.feeds, "source": r.source}
            for r in RULES if r.reader in keep]
