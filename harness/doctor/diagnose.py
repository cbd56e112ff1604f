"""One diagnosis: a target, a draft and optionally its features, to a :class:`Report`.

Shared by the ``doctor`` verb, ``doctor-demo`` and the tests: the caller hands in a
warm rank pool of one rank in SGLang's CPU engine mode (:func:`open_pool`; the parity
tier's pool in the tests) and a work directory for the shrunk checkpoints and the fix
candidates' configs. Stdlib-only at import time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from harness import progress


@dataclass
class Options:
    algorithm: Optional[str] = None            # --speculative-algorithm (default: from the draft)
    final_layer_capture: Optional[str] = None  # --speculative-final-layer-capture
    deepstack_capture: Optional[str] = None    # --speculative-deepstack-capture
    verify: bool = True                        # serve each proposed fix to check it
    max_files: int = 4
    max_tokens: int = 512
    reference_dtype: str = "float32"
    quiet: bool = False


def open_pool():
    """A warm pool of one rank in SGLang's CPU engine mode (the parity tier's)."""
    from harness.parity.runner import ENV, INIT_FN, PRELOAD
    from harness.ranks import get_pool

    return get_pool(1, "gloo", INIT_FN, env=dict(ENV), preload=PRELOAD, timeout=1200, start_timeout=900)


# Deepstack features of the served mapping: seeded, on every token.
DEEPSTACK_SEED = 5


class Shrunk:
    """The shrunk checkpoints of a work directory, made once per shrunk config: the
    directory, transformers' model, its terms over the mapping's prompts, and the rank
    job that serves them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self._made: dict[str, tuple[dict, dict, int]] = {}

    def get(self, tgt) -> tuple[dict[str, Any], dict, int]:
        """(the rank job's target fields, transformers' terms, the shrunk hidden size)."""
        import torch

        from harness.doctor import target as target_mod
        from harness.doctor import terms
        from harness.parity import reference

        fam = target_mod.shrunk_family(tgt)
        config = fam.config()
        digest = hashlib.sha256(json.dumps([fam.name, config], sort_keys=True, default=str).encode()).hexdigest()[:12]
        if digest in self._made:
            job, found, hidden = self._made[digest]
            return {**job, "target": str(tgt.path)}, found, hidden
        directory = self.workdir / f"shrunk-{fam.name}-{digest}"
        model = reference.make_checkpoint(fam, directory)
        text = config.get("text_config", config)
        hidden = int(text["hidden_size"])
        prompts = reference.prompts(int(config.get("vocab_size", text.get("vocab_size"))))
        job: dict[str, Any] = {"checkpoint": str(directory), "prompts": prompts,
                               "attention": fam.attention, "setup": fam.setup, "deepstack": None}
        if tgt.deepstack_layers:
            depth = len(tgt.deepstack_layers)
            total = sum(len(p) for p in prompts)
            gen = torch.Generator().manual_seed(DEEPSTACK_SEED)
            deepstack = torch.randn(depth, total, hidden, generator=gen)
            lm = model.model.language_model
            calls, start = [], 0
            for p in prompts:
                n = len(p)
                ids = torch.tensor([list(p)])
                calls.append(lambda ids=ids, s=start, n=n: lm(
                    inputs_embeds=lm.embed_tokens(ids), visual_pos_masks=torch.ones(1, n, dtype=torch.bool),
                    deepstack_visual_embeds=[d[s:s + n] for d in deepstack], output_hidden_states=True,
                    use_cache=False))
                start += n
            found = terms.collect(model, fam.hf_final_norm, calls)
            job["deepstack"] = torch.cat(list(deepstack), dim=-1)
        else:
            found = terms.collect(model, fam.hf_final_norm, terms.text_calls(model, prompts))
        self._made[digest] = (job, found, hidden)
        return {**job, "target": str(tgt.path)}, found, hidden


def diagnose(target_dir: Path, draft_dir: Path, features_path: Optional[Path], options: Options,
             pool, shrunk: Shrunk, base_label: str):
    """The report for ``draft_dir`` served on ``target_dir`` (see the package docstring)."""
    from harness.doctor import declared, features, rules, served, target, verdict

    say = (lambda _m: None) if options.quiet else progress
    decl = declared.read(Path(draft_dir), options.algorithm, base_label)
    tgt = target.read(Path(target_dir), base_label)
    declared.check_against_target(decl, tgt.hidden, tgt.layers)
    sequences = (features.load(Path(features_path), tgt.hidden, options.max_files, options.max_tokens)
                 if features_path else None)
    say(f"doctor: {tgt.family.name} target, {tgt.layers} layers; {decl.method} draft, ids "
        f"{decl.ids if decl.ids is not None else 'default'} ({decl.ids_key or 'no key SGLang reads'})")
    job, found, hidden = shrunk.get(tgt)
    as_configured = served.Variant(str(decl.path), decl.method, options.final_layer_capture,
                                   options.deepstack_capture)
    say("doctor: serving the draft on a shrunk copy of the target (SGLang's model and setters) ...")
    dtype, (served_cfg,) = served.run(pool, job, [as_configured], found, hidden)
    trained = None
    if sequences is not None:
        say(f"doctor: matching {len(sequences)} features file(s) against transformers on the target's weights ...")
        trained = features.match(tgt, sequences, options.reference_dtype)
    report = verdict.Report(base_label, tgt, decl, served_cfg, dtype, trained)
    ids = decl.ids
    verdict.assess(report, rules.pristine(base_label, tgt.family.name, decl.method, ids, tgt.layers,
                                          tgt.family.sglang_file),
                   rules.vllm(decl.method, verdict._declared_ids(decl), tgt.layers))
    report.rules = rules.table(base_label)
    proposals, unfixable = verdict.proposals(report)
    tried = []
    if proposals and options.verify:
        say(f"doctor: serving {len(proposals)} proposed change(s) to verify them ...")
        variants = []
        for n, p in enumerate(proposals):
            draft = (verdict.write_config(decl, p, shrunk.workdir / f"fix-{_serial()}-{n}")
                     if p.config else decl.path)
            variants.append(served.Variant(
                str(draft), decl.method,
                p.flags.get("--speculative-final-layer-capture", options.final_layer_capture),
                p.flags.get("--speculative-deepstack-capture", options.deepstack_capture), p.label))
        _, results = served.run(pool, job, variants, found, hidden)
        tried = list(zip(proposals, results))
    elif proposals:
        tried = [(p, served.Served(served.Variant(str(decl.path), decl.method, label=p.label),
                                   refused="not verified (--no-verify)")) for p in proposals[:1]]
    verdict.record(report, tried, unfixable)
    return report


_SERIAL = [0]


def _serial() -> int:
    _SERIAL[0] += 1
    return _SERIAL[0]
