"""Static upstream probes: does a SGLang release already carry one of our changes?

A probe reads a release's Python sources (from the wheel zip, or from a directory that
holds ``sglang/``) and looks for the *behaviour* a patch adds, with ``ast``, not for our
patch text. Probes are deliberately tolerant of upstream's own naming: they look for the
shape of the change (which method decides, what a conditional clone depends on, where a
capture happens relative to the layer loop), and they say which evidence they used.

Each probe returns a :class:`ProbeResult` with ``found``:

* ``True``: the change is present (upstream has it);
* ``False``: the anchors exist and the change is absent;
* ``None``: inconclusive, the code the probe anchors on is gone (e.g. a refactor).

Patches name their probe(s) with the ``Upstream-Probe:`` trailer. Stdlib only.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

COMMUNICATOR = "sglang/srt/layers/communicator.py"
DEEPSEEK_V2 = "sglang/srt/models/deepseek_v2.py"
AUX_MODULE = "sglang/srt/layers/aux_hidden_states.py"
LOGITS_PROCESSOR = "sglang/srt/layers/logits_processor.py"
CAPTURE_METHOD = "prepare_attn_and_capture_last_layer_outputs"
CAPTURE_KWARG = "captured_last_layer_outputs"


# ---------------------------------------------------------------- source access


class SourceTree:
    """Read-only view of a release's ``sglang/`` package sources."""

    def read(self, rel: str) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def names(self, prefix: str) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError

    def __init__(self) -> None:
        self._ast: dict[str, ast.Module | None] = {}

    def parse(self, rel: str) -> ast.Module | None:
        if rel not in self._ast:
            text = self.read(rel)
            try:
                self._ast[rel] = None if text is None else ast.parse(text, filename=rel)
            except SyntaxError:
                self._ast[rel] = None
        return self._ast[rel]


class DirTree(SourceTree):
    """``root`` holds ``sglang/`` (a site-packages dir, or ``<repo>/python``)."""

    def __init__(self, root: str | Path) -> None:
        super().__init__()
        self.root = Path(root)

    def read(self, rel: str) -> str | None:
        p = self.root / rel
        return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else None

    def names(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py"))


class ZipTree(SourceTree):
    """A wheel: members are ``sglang/...``; nothing is extracted or installed."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self._members = set(self._zip.namelist())

    def read(self, rel: str) -> str | None:
        if rel not in self._members:
            return None
        return self._zip.read(rel).decode("utf-8", errors="replace")

    def names(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        return sorted(m for m in self._members if m.startswith(prefix) and m.endswith(".py"))

    def close(self) -> None:
        self._zip.close()


class DictTree(SourceTree):
    """In-memory ``{rel: source}`` (test fixtures)."""

    def __init__(self, files: dict[str, str]) -> None:
        super().__init__()
        self.files = dict(files)

    def read(self, rel: str) -> str | None:
        return self.files.get(rel)

    def names(self, prefix: str) -> list[str]:
        prefix = prefix.rstrip("/") + "/"
        return sorted(k for k in self.files if k.startswith(prefix) and k.endswith(".py"))


# ---------------------------------------------------------------- results


@dataclass
class ProbeResult:
    probe: str
    found: bool | None
    evidence: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return {True: "present", False: "absent", None: "inconclusive"}[self.found]

    def to_json(self) -> dict:
        return {"probe": self.probe, "found": self.found, "verdict": self.verdict,
                "evidence": list(self.evidence)}


# ---------------------------------------------------------------- ast helpers


def find_class(mod: ast.Module | None, name: str) -> ast.ClassDef | None:
    if mod is None:
        return None
    for node in ast.walk(mod):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def arg_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    out = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    if a.vararg:
        out.add(a.vararg.arg)
    if a.kwarg:
        out.add(a.kwarg.arg)
    return out


def identifiers(node: ast.AST) -> set[str]:
    """Every Name id and Attribute attr under ``node`` (how code refers to things)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def self_calls(node: ast.AST) -> set[str]:
    """Names of ``self.<m>(...)`` calls under ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self"
        ):
            out.add(n.func.attr)
    return out


def calls_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == attr)
            or (isinstance(n.func, ast.Name) and n.func.id == attr)
        )
        for n in ast.walk(node)
    )


def passes_kwarg(node: ast.AST, kw: str) -> bool:
    return any(
        isinstance(n, ast.Call) and any(k.arg == kw for k in n.keywords) for n in ast.walk(node)
    )


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_hidden_plus_residual(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add)
        and {_leaf(node.left), _leaf(node.right)} == {"hidden_states", "residual"}
    )


def _leaf(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _layer_loops(fn: ast.AST) -> list[ast.For]:
    """``for`` loops over the decoder layers (their body indexes ``layers`` or calls
    ``layer``), outermost first."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.For):
            body = ast.Module(body=n.body, type_ignores=[])
            if "layers" in identifiers(body) or "layer" in _names_in(body):
                out.append(n)
    return sorted(out, key=lambda n: n.lineno)


def _stmt_lines(node: ast.AST) -> tuple[int, int]:
    return node.lineno, getattr(node, "end_lineno", node.lineno) or node.lineno


def _capture_membership(node: ast.AST, loop_vars: set[str]) -> list[ast.Compare]:
    """``X in <...layers_to_capture>`` comparisons where X is not a loop variable."""
    out = []
    for n in ast.walk(node):
        if not isinstance(n, ast.Compare):
            continue
        for op, right in zip(n.ops, n.comparators):
            if isinstance(op, ast.In) and "layers_to_capture" in identifiers(right):
                if not (_names_in(n.left) & loop_vars) or "end_layer" in identifiers(n.left):
                    out.append(n)
    return out


def _norm_call_lines(fn: ast.AST) -> list[int]:
    lines = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "norm" and _leaf(f.value) == "self":
                lines.append(n.lineno)
            # successor style: something.norm(hidden_states, ..., self.norm)
            elif any(isinstance(a, ast.Attribute) and a.attr == "norm"
                     and _leaf(a.value) == "self" for a in n.args):
                lines.append(n.lineno)
    return lines


# ---------------------------------------------------------------- probes


def probe_comm_readonly_residual(tree: SourceTree) -> ProbeResult:
    """A: the communicator decides whether the post-attn residual is read-only.

    Present when ``LayerCommunicator.prepare_attn_and_capture_last_layer_outputs`` takes
    ``quant_format`` and clones the captured residual under a condition that (directly or
    through a ``self.<method>()`` it calls) depends on ``apply_flashinfer_allreduce_fusion``
    and ``input_scattered``. If ``LayerCommunicator`` is gone, a successor capture path (a
    function taking ``captured_last_layer_outputs`` and ``quant_format`` that decides
    ownership of the capture under a condition) is accepted, and reported as such.
    """
    r = ProbeResult("comm-readonly-residual", None)
    rel = COMMUNICATOR
    cls = find_class(tree.parse(rel), "LayerCommunicator")
    if cls is None:
        for cand in tree.names("sglang/srt/layers"):
            cls = find_class(tree.parse(cand), "LayerCommunicator")
            if cls is not None:
                rel = cand
                break
    if cls is None:
        return _comm_successor(tree, r)
    ms = methods(cls)
    cap = ms.get(CAPTURE_METHOD)
    if cap is None:
        r.found = False
        r.evidence.append(f"{rel}: LayerCommunicator has no {CAPTURE_METHOD}")
        return r
    takes_quant = "quant_format" in arg_names(cap)
    deciders: list[str] = []
    decided = False
    for n in ast.walk(cap):
        if isinstance(n, (ast.If, ast.IfExp)):
            branch = n.body if isinstance(n, ast.If) else [n.body]
            has_clone = any(calls_attr(b, "clone") for b in branch)
            if not has_clone:
                continue
            test_ids = identifiers(n.test)
            for m in self_calls(n.test):
                if m in ms and m != CAPTURE_METHOD:
                    test_ids |= identifiers(ms[m])
                    deciders.append(m)
            if {"apply_flashinfer_allreduce_fusion", "input_scattered"} <= test_ids:
                who = f"self.{deciders[-1]}()" if deciders else "inline condition"
                r.evidence.append(
                    f"{rel}:{n.lineno}: {CAPTURE_METHOD} clones only unless {who} "
                    "(uses apply_flashinfer_allreduce_fusion + input_scattered)"
                )
                decided = True
                break
    else:
        r.evidence.append(
            f"{rel}: {CAPTURE_METHOD} has no clone conditioned on the fused-allreduce path"
        )
    r.evidence.append(
        f"{rel}: {CAPTURE_METHOD} {'takes' if takes_quant else 'does not take'} quant_format"
    )
    r.found = decided and takes_quant
    return r


def _comm_successor(tree: SourceTree, r: ProbeResult) -> ProbeResult:
    for rel in tree.names("sglang/srt/layers"):
        mod = tree.parse(rel)
        if mod is None:
            continue
        for fn in ast.walk(mod):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = arg_names(fn)
            capture_args = sorted(a for a in args if "captur" in a)
            if not capture_args or "quant_format" not in args:
                continue
            # ownership decided conditionally: owned=<expr> / a conditional .clone()
            owned = [
                k for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords
                if k.arg == "owned" and not isinstance(k.value, ast.Constant)
            ]
            cond_clone = any(
                isinstance(n, (ast.If, ast.IfExp)) and calls_attr(n, "clone")
                for n in ast.walk(fn)
            )
            if owned or cond_clone:
                r.found = True
                r.evidence.append(
                    f"LayerCommunicator removed upstream; successor {rel}:{fn.lineno} "
                    f"{fn.name}({capture_args[0]}, quant_format) decides capture ownership "
                    f"({'owned=<condition>' if owned else 'conditional clone'})"
                )
                return r
    r.found = None
    r.evidence.append(f"{COMMUNICATOR}: no LayerCommunicator and no successor capture path")
    return r


def _dsv2(tree: SourceTree) -> tuple[ast.Module | None, ast.ClassDef | None, ast.ClassDef | None]:
    mod = tree.parse(DEEPSEEK_V2)
    return mod, find_class(mod, "DeepseekV2DecoderLayer"), find_class(mod, "DeepseekV2Model")


def _hands_collector_to_communicator(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``self.<x>.<m>(..., <capture param>, ...)``: the layer's capture-collector parameter
    flows into a call on one of its sub-objects (communicator / boundary). Returns the
    call as text, or ''."""
    params = {a for a in arg_names(fn) if "captur" in a}
    for n in ast.walk(fn):
        if not (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Attribute)
            and _leaf(n.func.value.value) == "self"
        ):
            continue
        values = list(n.args) + [k.value for k in n.keywords]
        for v in values:
            if isinstance(v, ast.Name) and v.id in params:
                kw = next((k.arg for k in n.keywords if k.value is v), None)
                return f"self.{n.func.value.attr}.{n.func.attr}({kw + '=' if kw else ''}{v.id})"
    return ""


def probe_dsv2_capture_after_allreduce(tree: SourceTree) -> ProbeResult:
    """A: the decoder layer captures through the communicator (post all-reduce), and the
    model's layer loop no longer builds ``hidden_states + residual`` itself."""
    r = ProbeResult("dsv2-capture-after-allreduce", None)
    mod, layer, model = _dsv2(tree)
    if mod is None or layer is None or model is None:
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2DecoderLayer/DeepseekV2Model not found")
        return r
    lfwd = methods(layer).get("forward")
    mfwd = methods(model).get("forward")
    if lfwd is None or mfwd is None:
        r.evidence.append(f"{DEEPSEEK_V2}: forward() not found")
        return r
    if calls_attr(lfwd, CAPTURE_METHOD):
        layer_ok = True
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2DecoderLayer.forward calls {CAPTURE_METHOD}")
    elif _hands_collector_to_communicator(lfwd):
        layer_ok = True
        r.evidence.append(
            f"{DEEPSEEK_V2}: DeepseekV2DecoderLayer.forward hands its capture collector "
            f"({_hands_collector_to_communicator(lfwd)}) to its communicator (successor API)"
        )
    else:
        layer_ok = False
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2DecoderLayer.forward does not capture")
    loops = _layer_loops(mfwd)
    if not loops:
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2Model.forward has no layer loop")
        r.found = False if not layer_ok else None
        return r
    in_loop = [
        n.lineno for lp in loops for n in ast.walk(lp) if _is_hidden_plus_residual(n)
    ]
    if in_loop:
        r.evidence.append(
            f"{DEEPSEEK_V2}:{in_loop[0]}: model layer loop still builds hidden_states + residual"
        )
    else:
        r.evidence.append(f"{DEEPSEEK_V2}: model layer loop builds no hidden_states + residual")
    r.found = layer_ok and not in_loop
    return r


def probe_aux_packer(tree: SourceTree) -> ProbeResult:
    """B: a packer class in ``layers/aux_hidden_states.py`` and a logits processor that
    accepts the packed tensor."""
    r = ProbeResult("aux-packer", None)
    lp = tree.parse(LOGITS_PROCESSOR)
    mod = tree.parse(AUX_MODULE)
    if mod is None:
        r.found = False if lp is not None else None
        r.evidence.append(f"{AUX_MODULE}: missing")
        return r
    packer = None
    how = ""
    for cls in (n for n in ast.walk(mod) if isinstance(n, ast.ClassDef)):
        ms = methods(cls)
        if "finalize" not in ms or not ({"append", "capture"} & set(ms)):
            continue
        attrs = {
            t.id
            for st in cls.body
            if isinstance(st, (ast.Assign, ast.AnnAssign))
            for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
            if isinstance(t, ast.Name)
        }
        if "copies_on_append" in attrs:
            packer, how = cls, "declares copies_on_append"
        elif "append" in ms and calls_attr(ms["append"], "copy_"):
            packer, how = cls, "append() copies into a preallocated buffer (copy_)"
        elif "capture" in ms and "owned" in arg_names(ms["capture"]):
            packer, how = cls, "capture(owned=...) ownership protocol"
        if packer is not None:
            break
    if packer is None:
        r.found = False
        r.evidence.append(f"{AUX_MODULE}: no class with finalize() + append()/copy semantics")
        return r
    r.evidence.append(f"{AUX_MODULE}:{packer.lineno}: class {packer.name}: finalize(), {how}")
    if lp is None:
        r.evidence.append(f"{LOGITS_PROCESSOR}: missing")
        r.found = None
        return r
    imports_pack = any(
        isinstance(n, ast.ImportFrom)
        and n.module is not None
        and n.module.endswith("aux_hidden_states")
        for n in ast.walk(lp)
    )
    isinstance_tensor = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "isinstance"
        and len(n.args) == 2
        and any("aux" in x for x in identifiers(n.args[0]))
        and "Tensor" in identifiers(n.args[1])
        for n in ast.walk(lp)
    )
    if imports_pack or isinstance_tensor:
        what = []
        if imports_pack:
            what.append("imports from layers.aux_hidden_states")
        if isinstance_tensor:
            what.append("isinstance(aux..., torch.Tensor)")
        r.evidence.append(f"{LOGITS_PROCESSOR}: accepts packed tensor ({', '.join(what)})")
        r.found = True
    else:
        r.evidence.append(f"{LOGITS_PROCESSOR}: only handles a list of aux hidden states")
        r.found = False
    return r


def probe_dsv2_capture_final_layer(tree: SourceTree) -> ProbeResult:
    """C: after the layer loop and before the final norm, DeepseekV2Model.forward captures
    the last layer's output when ``end_layer`` is requested."""
    r = ProbeResult("dsv2-capture-final-layer", None)
    mod, _, model = _dsv2(tree)
    mfwd = methods(model).get("forward") if model is not None else None
    if mfwd is None:
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2Model.forward not found")
        return r
    loops = _layer_loops(mfwd)
    if not loops:
        r.evidence.append(f"{DEEPSEEK_V2}: DeepseekV2Model.forward has no layer loop")
        return r
    loop = loops[0]
    loop_end = _stmt_lines(loop)[1]
    loop_vars = _names_in(loop.target)
    norms = [ln for ln in _norm_call_lines(mfwd) if ln > loop_end]
    norm_line = min(norms) if norms else None

    def final_membership(node: ast.AST) -> bool:
        return any(
            {"end_layer", "layers"} & identifiers(c.left)
            for c in _capture_membership(node, loop_vars)
        )

    # flags computed anywhere in forward: ``capture_final = ... end_layer in layers_to_capture``
    flags = {
        t.id
        for n in ast.walk(mfwd)
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
        and final_membership(n.value)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    hits = []
    for stmt in ast.walk(mfwd):
        if not isinstance(stmt, ast.If) or stmt.lineno <= loop_end:
            continue
        if norm_line is not None and stmt.lineno >= norm_line:
            continue
        guarded = final_membership(stmt.test) or bool(_names_in(stmt.test) & flags)
        captures = any(
            calls_attr(b, m) for b in stmt.body for m in ("append", "capture", "copy_")
        )
        if guarded and captures:
            hits.append(stmt.lineno)
    if hits:
        r.found = True
        how = "via flag " + ", ".join(sorted(flags)) if flags else "inline end_layer check"
        r.evidence.append(
            f"{DEEPSEEK_V2}:{min(hits)}: final-layer capture after the layer loop "
            f"(ends line {loop_end}){' and before the final norm' if norm_line else ''} ({how})"
        )
    else:
        r.found = False
        r.evidence.append(
            f"{DEEPSEEK_V2}: no end_layer-in-layers_to_capture capture between the layer "
            f"loop (ends line {loop_end}) and the final norm"
            + (f" (line {norm_line})" if norm_line else "")
        )
    return r


def probe_capture_gather_scattered(tree: SourceTree) -> ProbeResult:
    """D: the communicator's capture gathers an input-scattered residual.

    Present when ``LayerCommunicator.prepare_attn_and_capture_last_layer_outputs`` (or a
    ``self.<method>()`` it calls for the capture, other than ``prepare_attn``, whose own
    reduce-scatter does not count) refers to ``input_scattered`` and performs an
    all-gather. Inconclusive when upstream has replaced ``LayerCommunicator``.
    """
    r = ProbeResult("capture-gather-scattered", None)
    cls = find_class(tree.parse(COMMUNICATOR), "LayerCommunicator")
    if cls is None:
        r.evidence.append(
            f"{COMMUNICATOR}: no LayerCommunicator (rewritten upstream); decide with the "
            "patch's regression tests"
        )
        return r
    ms = methods(cls)
    cap = ms.get(CAPTURE_METHOD)
    if cap is None:
        r.found = False
        r.evidence.append(f"{COMMUNICATOR}: LayerCommunicator has no {CAPTURE_METHOD}")
        return r
    seen: set[str] = set()
    todo = [CAPTURE_METHOD]
    ids: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in ms or name == "prepare_attn":
            continue
        seen.add(name)
        ids |= identifiers(ms[name])
        todo.extend(self_calls(ms[name]))
    gathers = {i for i in ids if "all_gather" in i}
    if "input_scattered" in ids and gathers:
        r.found = True
        r.evidence.append(
            f"{COMMUNICATOR}: capture path ({', '.join(sorted(seen))}) checks input_scattered "
            f"and gathers ({', '.join(sorted(gathers))})"
        )
    else:
        r.found = False
        r.evidence.append(
            f"{COMMUNICATOR}: capture path ({', '.join(sorted(seen))}) does not gather an "
            "input-scattered residual"
        )
    return r


# ---------------------------------------------------------------- every capturing model

MODELS = "sglang/srt/models/"
# (file, class whose forward captures) per patch of the model-wide series.
DEFERRING_MODELS = [
    ("gpt_oss.py", "GptOssModel"),
    ("glm4_moe.py", "Glm4MoeModel"),
    ("glm4_moe_lite.py", "Glm4MoeLiteModel"),
    ("bailing_moe.py", "BailingMoEModel"),
    ("qwen3_vl_moe.py", "Qwen3MoeLLMModel"),
]
CAPTURING_MODELS = DEFERRING_MODELS + [
    ("apertus.py", "ApertusModel"),
    ("arcee.py", "ArceeModel"),
    ("exaone_moe.py", "ExaoneMoEModel"),
    ("gemma3_causal.py", "Gemma3TextModel"),
    ("gemma4_causal.py", "Gemma4TextModel"),
    ("glm4.py", "Glm4Model"),
    ("granitemoehybrid.py", "GraniteMoeHybridModel"),
    ("llama.py", "LlamaModel"),
    ("llama4.py", "Llama4Model"),
    ("longcat_flash.py", "LongcatFlashModel"),
    ("minimax_m2.py", "MiniMaxM2Model"),
    ("qwen2.py", "Qwen2Model"),
    ("qwen2_moe.py", "Qwen2MoeModel"),
    ("qwen3_5.py", "Qwen3_5ForCausalLM"),
    ("qwen3_next.py", "Qwen3NextModel"),
    ("qwen3_vl.py", "Qwen3LLMModel"),
]
# gemma3/gemma4 captured the last layer at the pin already.
FINAL_LAYER_MODELS = [m for m in CAPTURING_MODELS if m[0] not in ("gemma3_causal.py", "gemma4_causal.py")]
# The models whose two-batch-overlap path can run: OperationsStrategy.init_new_tbo has a
# strategy for their decoder layers (DeepseekV2DecoderLayer; Qwen3MoeDecoderLayer, which
# qwen3_moe runs through Qwen2MoeModel.forward). glm4_moe, glm4_moe_lite, minimax_m2 and
# qwen2_moe's own layers raise NotImplementedError there, capturing or not.
TBO_MODELS = [
    ("deepseek_v2.py", "DeepseekV2Model"),
    ("qwen2_moe.py", "Qwen2MoeModel"),
]


def _forward_of(tree: SourceTree, file: str, cls: str):
    mod = tree.parse(MODELS + file)
    c = find_class(mod, cls)
    return None if c is None else methods(c).get("forward")


def _per_model(name: str, tree: SourceTree, models, check) -> ProbeResult:
    """Run ``check(forward) -> (bool | None, evidence)`` on each model's forward; present
    only when every model has the change."""
    r = ProbeResult(name, None)
    verdicts = []
    for file, cls in models:
        fwd = _forward_of(tree, file, cls)
        if fwd is None:
            verdicts.append(None)
            r.evidence.append(f"{MODELS}{file}: {cls}.forward not found")
            continue
        found, why = check(fwd)
        verdicts.append(found)
        r.evidence.append(f"{MODELS}{file}:{fwd.lineno}: {cls}: {why}")
    r.found = combine([ProbeResult(name, v) for v in verdicts])
    return r


def _capture_kwargs(node: ast.AST) -> list[str]:
    """Keyword arguments that hand a capture collector/callback to a callee."""
    return sorted({
        k.arg for n in ast.walk(node) if isinstance(n, ast.Call)
        for k in n.keywords if k.arg and "captur" in k.arg
    })


def probe_models_capture_after_allreduce(tree: SourceTree) -> ProbeResult:
    """Every model whose layers defer the all-reduce captures through its layers (which
    capture after the deferred all-reduce), not ``hidden_states + residual`` in its loop."""

    def check(fwd):
        loops = _layer_loops(fwd)
        sums = [n.lineno for lp in loops for n in ast.walk(lp) if _is_hidden_plus_residual(n)
                and any(calls_attr(p, m) for p in [lp] for m in ("append", "capture"))]
        handed = _capture_kwargs(ast.Module(body=[lp for lp in loops], type_ignores=[]))
        if sums and not handed:
            return False, f"captures hidden_states + residual in its layer loop (line {sums[0]})"
        if handed and not sums:
            return True, f"hands a capture to its layers ({', '.join(handed)})"
        return None, "no capture in its layer loop" if not sums else "captures in the loop and hands one down"

    return _per_model("models-capture-after-allreduce", tree, DEFERRING_MODELS, check)


def probe_models_aux_packer(tree: SourceTree) -> ProbeResult:
    """Every capturing model collects with AuxHiddenStatePacker, not a list."""

    def check(fwd):
        ids = identifiers(fwd)
        if "AuxHiddenStatePacker" in ids:
            return True, "collects with AuxHiddenStatePacker"
        listy = [n.lineno for n in ast.walk(fwd) if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and "aux" in t.id for t in n.targets)
                 and (isinstance(n.value, ast.List) or (isinstance(n.value, ast.Call)
                      and "AuxHiddenStateList" in identifiers(n.value.func)))]
        if listy:
            return False, f"collects into a list (line {listy[0]})"
        return None, "no aux collector found"

    return _per_model("models-aux-packer", tree, CAPTURING_MODELS, check)


def probe_models_capture_final_layer(tree: SourceTree) -> ProbeResult:
    """Every model that captures at its layer inputs also captures the last layer's
    output after its loop when ``end_layer`` (or its no-PP equivalent) is requested."""

    def check(fwd):
        loops = _layer_loops(fwd)
        if not loops:
            return None, "no layer loop"
        loop_end = max(_stmt_lines(lp)[1] for lp in loops)
        hits = []
        for n in ast.walk(fwd):
            if getattr(n, "lineno", 0) <= loop_end:
                continue
            if isinstance(n, ast.Compare) and any(
                isinstance(op, ast.In) for op in n.ops
            ) and any("layers_to_capture" in identifiers(c) for c in n.comparators):
                left = identifiers(n.left)
                if left & {"end_layer", "num_layers", "layers", "total_num_layers", "num_hidden_layers"}:
                    hits.append(n.lineno)
        if hits:
            return True, f"captures the last layer after its loop (line {min(hits)})"
        return False, f"nothing captures end_layer after its loop (ends line {loop_end})"

    return _per_model("models-capture-final-layer", tree, FINAL_LAYER_MODELS, check)


def probe_models_capture_no_shortfall(tree: SourceTree) -> ProbeResult:
    """Models with a two-batch-overlap path do not take it for a capturing forward."""

    def check(fwd):
        conds = [n for n in ast.walk(fwd) if isinstance(n, ast.If)
                 and "can_run_tbo" in identifiers(n.test)]
        if not conds:
            return None, "no can_run_tbo branch"
        guarded = [c.lineno for c in conds if identifiers(c.test) & {
            "layers_to_capture", "aux_hidden_states", "capture_aux_hidden_states"}]
        if guarded:
            return True, f"the TBO branch (line {guarded[0]}) is not taken when capturing"
        return False, f"takes the TBO path while capturing (line {conds[0].lineno})"

    return _per_model("models-capture-no-shortfall", tree, TBO_MODELS, check)


def probe_qwen3_next_last_layer_allreduce(tree: SourceTree) -> ProbeResult:
    """qwen3_next's last layer never defers its all-reduce into the final norm: its
    LayerCommunicators know the last layer, or (the layer-boundary rewrite) the model
    completes the owed sum before the final norm."""
    r = ProbeResult("qwen3-next-last-layer-allreduce", None)
    rel = MODELS + "qwen3_next.py"
    mod = tree.parse(rel)
    if mod is None:
        r.evidence.append(f"{rel}: not found")
        return r
    comms = [n for n in ast.walk(mod) if isinstance(n, ast.Call)
             and _leaf(n.func) == "LayerCommunicator"]
    if comms:
        missing = [c.lineno for c in comms if not any(k.arg == "is_last_layer" for k in c.keywords)]
        r.found = not missing
        r.evidence.append(
            f"{rel}: LayerCommunicator(...) at lines {', '.join(str(c.lineno) for c in comms)}"
            + (f"; without is_last_layer at {', '.join(map(str, missing))}" if missing
               else ": all pass is_last_layer")
        )
        return r
    fwd = _forward_of(tree, "qwen3_next.py", "Qwen3NextModel")
    if fwd is not None and identifiers(fwd) & {"complete_output", "final_norm"}:
        r.found = True
        r.evidence.append(f"{rel}: no LayerCommunicator; Qwen3NextModel.forward completes the "
                          "owed sum before the final norm (layer-boundary rewrite)")
    else:
        r.evidence.append(f"{rel}: no LayerCommunicator and no completing final norm found")
    return r


PROBES: dict[str, Callable[[SourceTree], ProbeResult]] = {
    "comm-readonly-residual": probe_comm_readonly_residual,
    "dsv2-capture-after-allreduce": probe_dsv2_capture_after_allreduce,
    "aux-packer": probe_aux_packer,
    "dsv2-capture-final-layer": probe_dsv2_capture_final_layer,
    "capture-gather-scattered": probe_capture_gather_scattered,
    "models-capture-after-allreduce": probe_models_capture_after_allreduce,
    "models-aux-packer": probe_models_aux_packer,
    "qwen3-next-last-layer-allreduce": probe_qwen3_next_last_layer_allreduce,
    "models-capture-final-layer": probe_models_capture_final_layer,
    "models-capture-no-shortfall": probe_models_capture_no_shortfall,
}


def run_probes(tree: SourceTree, probe_ids: Iterable[str]) -> list[ProbeResult]:
    out = []
    for pid in probe_ids:
        fn = PROBES.get(pid)
        if fn is None:
            out.append(ProbeResult(pid, None, [f"unknown probe id {pid!r}"]))
        else:
            out.append(fn(tree))
    return out


def combine(results: list[ProbeResult]) -> bool | None:
    """All present -> True; any absent -> False; else None."""
    if not results:
        return None
    if any(x.found is False for x in results):
        return False
    if all(x.found is True for x in results):
        return True
    return None


def iter_probe_ids(value: str | None) -> Iterator[str]:
    for part in (value or "").replace(",", " ").split():
        yield part.strip()
