"""transformers' terms: every value a slot of aux hidden states could hold, computed by
transformers' real model classes, and matching a slot against them.

A *term* names one stream of the target, as transformers computes it:

* ``hidden_states[i]`` (``i = 0 .. L``): entry ``i`` of ``output_hidden_states``. For
  ``i < L`` the stream entering decoder layer ``i`` (decoder layer ``i - 1``'s output;
  ``0``: the embeddings); entry ``L`` is after the final norm: the ``post_norm`` value
  of a last-layer capture;
* ``pre_norm``: the stream entering the final norm (a forward pre-hook on it): the last
  layer's output, the ``pre_norm`` value;
* ``hidden_states[i]+deepstack[i-1]`` (Qwen3-VL, ``i`` a deepstack layer + 1): the stream
  entering decoder layer ``i`` where it differs from ``hidden_states[i]`` (transformers 5
  records a layer's output before its deepstack addition, 4.57 after it): the
  ``post_deepstack`` value;
* ``branch[i]``: decoder layer ``i - 1``'s last residual branch (its MLP's output, Gemma's
  post-feedforward norm's), without the residual stream: what a capture of
  ``hidden_states`` alone holds where a layer hands on its output and residual apart
  (sgl-project/sglang#39286, Gemma3).

Stdlib-only at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

# A slot matches its best term when the relative error (Frobenius, whole [T, H] slot) is
# at most MATCH_TOL; features saved in bfloat16 from a bfloat16 target differ from a
# float32 transformers run by about 1e-2 after tens of layers, every wrong term by
# tens of percent. The best term is *ambiguous* when the runner-up is within
# AMBIGUOUS_RATIO of it.
MATCH_TOL = 0.05
AMBIGUOUS_RATIO = 3.0
# Modules whose output is a decoder layer's last residual branch, in the order tried.
BRANCH_MODULES = ("post_feedforward_layernorm", "mlp", "feed_forward", "block_sparse_moe")


@dataclass(frozen=True, order=True)
class Term:
    index: int      # the capture index: the stream between decoder layers index-1 and index
    kind: str       # "hs" | "pre_norm" | "post_deepstack" | "branch"

    def key(self) -> str:
        if self.kind == "hs":
            return f"hidden_states[{self.index}]"
        if self.kind == "pre_norm":
            return "pre_norm"
        if self.kind == "post_deepstack":
            return f"hidden_states[{self.index}]+deepstack[{self.index - 1}]"
        return f"branch[{self.index}]"

    def describe(self, layers: int) -> str:
        """In words, for the table."""
        if self.kind == "pre_norm":
            return f"layer {layers - 1}'s output before the final norm (pre_norm)"
        if self.kind == "hs" and self.index == layers:
            return f"hidden_states[{layers}]: after the final norm (post_norm)"
        if self.kind == "hs" and self.index == 0:
            return "hidden_states[0]: the embeddings"
        if self.kind == "hs":
            return f"hidden_states[{self.index}]: layer {self.index - 1}'s output"
        if self.kind == "post_deepstack":
            return (f"hidden_states[{self.index}] + deepstack[{self.index - 1}]: layer {self.index - 1}'s "
                    "output after the deepstack addition (post_deepstack)")
        return f"branch[{self.index}]: layer {self.index - 1}'s last branch, without the residual"

    @property
    def layer_output(self) -> Optional[int]:
        """The decoder layer whose output this is (None for the embeddings)."""
        return None if self.index == 0 else self.index - 1


def parse(key: str, layers: int) -> Term:
    """The inverse of :meth:`Term.key` (``layers``: the target's ``L``, pre_norm's index)."""
    if key == "pre_norm":
        return Term(layers, "pre_norm")
    if key.startswith("hidden_states[") and "+deepstack[" in key:
        return Term(int(key[len("hidden_states["):key.index("]")]), "post_deepstack")
    if key.startswith("hidden_states["):
        return Term(int(key[len("hidden_states["):-1]), "hs")
    if key.startswith("branch["):
        return Term(int(key[len("branch["):-1]), "branch")
    raise ValueError(f"not a term: {key!r}")


def _module(root: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), root)


def decoder_layers(model, final_norm: str):
    """The decoder layers beside the final norm (``model.layers`` for ``model.norm``)."""
    parent = _module(model, final_norm.rsplit(".", 1)[0]) if "." in final_norm else model
    layers = getattr(parent, "layers", None)
    if layers is None:
        raise RuntimeError(f"no decoder layers beside {final_norm}")
    return layers


def collect(model, final_norm: str, calls: Iterable[Callable[[], Any]]) -> dict[Term, Any]:
    """Every term, ``[rows, hidden]`` float32, over the rows of each ``call()`` (a
    transformers forward with ``output_hidden_states=True`` of one sequence),
    concatenated in order. The last term index is ``L``; ``pre_norm`` is keyed
    ``Term(L, "pre_norm")``."""
    import torch

    layers = decoder_layers(model, final_norm)
    norm = _module(model, final_norm)
    entering: dict[int, list] = {}
    branch: dict[int, list] = {}
    pre_norm: list = []

    def take(store: list):
        def hook(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            store.append(x[0].detach().float().clone())
        return hook

    def out_hook(store: list):
        def hook(_module, _args, out):
            x = out[0] if isinstance(out, tuple) else out
            store.append((x[0] if x.dim() == 3 else x).detach().float().clone())
        return hook

    handles = [norm.register_forward_pre_hook(take(pre_norm), with_kwargs=True)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(take(entering.setdefault(i, [])), with_kwargs=True))
        for name in BRANCH_MODULES:
            sub = getattr(layer, name, None)
            if sub is not None:
                handles.append(sub.register_forward_hook(out_hook(branch.setdefault(i + 1, []))))
                break
    hidden: list[list] = []
    try:
        with torch.no_grad():
            for call in calls:
                before = len(pre_norm)
                out = call()
                if len(pre_norm) != before + 1:
                    raise RuntimeError(f"transformers' {final_norm} ran {len(pre_norm) - before} times")
                hidden.append([h[0].float() for h in out.hidden_states])
    finally:
        for h in handles:
            h.remove()
    num = len(layers)
    terms: dict[Term, Any] = {}
    for i in range(num + 1):
        terms[Term(i, "hs")] = torch.cat([h[i] for h in hidden])
    terms[Term(num, "pre_norm")] = torch.cat(pre_norm)
    for i in range(1, num):
        stream = torch.cat(entering[i])
        if not torch.allclose(stream, terms[Term(i, "hs")], rtol=0, atol=1e-6):
            terms[Term(i, "post_deepstack")] = stream
    for i, rows in branch.items():
        if len(rows) == len(hidden):
            terms[Term(i, "branch")] = torch.cat(rows)
    return terms


def text_calls(model, sequences: Sequence[Sequence[int]]) -> list[Callable[[], Any]]:
    import torch

    return [functools.partial(model, torch.tensor([list(s)]), output_hidden_states=True, use_cache=False)
            for s in sequences]


def relative_error(got, want) -> float:
    import torch

    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return float("inf")
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-12))


@dataclass(frozen=True)
class Match:
    """A slot's best term and its runner-up, with their relative errors."""

    term: Optional[Term]          # None: no term within MATCH_TOL
    error: float
    runner_up: Optional[Term]
    runner_up_error: float
    best: Term                    # the closest term, within MATCH_TOL or not

    @property
    def ambiguous(self) -> bool:
        return self.term is not None and self.runner_up_error <= AMBIGUOUS_RATIO * max(self.error, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {"term": self.term.key() if self.term else None, "error": _round(self.error),
                "best": self.best.key(),
                "runner_up": self.runner_up.key() if self.runner_up else None,
                "runner_up_error": _round(self.runner_up_error), "ambiguous": self.ambiguous}


def _round(x: float) -> Optional[float]:
    return None if x == float("inf") else float(f"{x:.3g}")


def match(got, terms: dict[Term, Any], tol: float = MATCH_TOL) -> Match:
    """The term of ``terms`` closest to ``got`` (``[rows, hidden]``), and the next one."""
    ranked = sorted((relative_error(got, want), term) for term, want in terms.items())
    (err, best), rest = ranked[0], ranked[1:]
    runner = rest[0] if rest else (float("inf"), None)
    return Match(best if err <= tol else None, err, runner[1], runner[0], best)


def split_slots(aux, hidden: int) -> list:
    """``[rows, K * hidden]`` -> K tensors of ``[rows, hidden]``."""
    if aux.shape[-1] % hidden:
        raise ValueError(f"captures {tuple(aux.shape)} are not a multiple of hidden size {hidden} wide")
    return [aux[:, k * hidden:(k + 1) * hidden] for k in range(aux.shape[-1] // hidden)]
