"""Drift: do the PR bundles in ``build/pr/`` still apply to SGLang releases newer than
their base?

A bundle is verified on its ``base_release`` (``bundle.json``); upstream keeps moving.
For every release on the index after that base (:func:`releases_after`), the release's
files are laid out as ``upstream-status`` does (:func:`lay_out_release`, one hash-checked
wheel per release, cached), the bundle's ``deps/*.patch`` then its own patch go through
:func:`check_apply` (``git apply --check``: no fuzz, offsets allowed), and the result is
``applies``, ``conflicts`` (files and hunks named) or ``landed`` (the patch's
``Upstream-Probe`` finds it in the release). Each ``bundle.json`` gets a ``drift`` key.

Drift is information, not a gate: an unreachable index with nothing cached gives one line
``drift: not checked: <reason>`` and no error. ``pr-export`` runs it after the bundles
are written (:func:`report_drift`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import HarnessError, progress
from harness.patchset.layout import Layout
from harness.patchset.pin import load_pin
from harness.patchset.pypi import fetch_index, pick_wheel, release_wheel, releases_after, version_key
from harness.patchset.scratch import scratch
from harness.upstream.probes import ZipTree, combine, run_probes
from harness.upstream.status import Patch, check_apply, lay_out_release

CURRENT, BEHIND, NOT_CHECKED = "current", "behind", "not checked"


# ---------------------------------------------------------------- bundles


@dataclass
class Bundle:
    dir: Path
    id: str
    base_release: str
    deps: list[Patch]
    patches: list[Patch]

    @property
    def files(self) -> list[str]:
        return sorted({f for p in self.deps + self.patches for f in p.files})


def load_bundle(dest: Path) -> Bundle:
    meta = json.loads((dest / "bundle.json").read_text())
    missing = [k for k in ("id", "base_release", "patches") if not meta.get(k)]
    if missing:
        raise HarnessError(f"{dest / 'bundle.json'}: no {', '.join(missing)}")
    return Bundle(
        dir=dest, id=meta["id"], base_release=meta["base_release"],
        deps=[Patch.from_file(p) for p in sorted((dest / "deps").glob("*.patch"))],
        patches=[Patch.from_file(dest / n) for n in meta["patches"]],
    )


# ---------------------------------------------------------------- one bundle on one release


def apply_bundle(repo: Path, bundle: Bundle) -> dict[str, Any]:
    """deps/ then the patch, each with ``git apply --check`` then applied (``repo`` is the
    release laid out); the problems of a dep are prefixed with ``deps/<name>``."""
    out: dict[str, Any] = {"ok": True, "files": [], "problems": [], "offsets": []}
    labelled = [(f"deps/{p.name}: ", p) for p in bundle.deps] + [("", p) for p in bundle.patches]
    for prefix, p in labelled:
        res = check_apply(repo, p)
        out["ok"] = out["ok"] and res.ok
        out["problems"] += [prefix + x for x in res.problems]
        out["offsets"] += [prefix + x for x in res.offsets]
        out["files"] += [f for f in res.files if f not in out["files"]]
    return out


def bundle_cell(wheel: Path, tree: ZipTree, bundle: Bundle, probes: list[str], work: Path) -> dict[str, Any]:
    repo = work / bundle.id
    lay_out_release(wheel, repo, bundle.files)
    applied = apply_bundle(repo, bundle)
    landed = combine(run_probes(tree, probes)) if probes else None
    status = "landed" if landed else ("applies" if applied["ok"] else "conflicts")
    return {"status": status, "landed": landed, "probes": probes, "apply": applied}


def release_cells(lay: Layout, index: dict[str, Any], version: str, bundles: list[Bundle],
                  probes: dict[str, list[str]], package: str) -> dict[str, dict[str, Any]]:
    """{bundle id: cell} for the bundles based before ``version``."""
    try:
        wheel = release_wheel(lay.cache, index, pick_wheel(index, version, package))
    except HarnessError as exc:
        return {b.id: {"status": NOT_CHECKED, "reason": str(exc)} for b in bundles}
    tree = ZipTree(wheel)
    try:
        with scratch(lay.build, "drift") as tmp:
            return {b.id: bundle_cell(wheel, tree, b, probes.get(b.id, []), tmp) for b in bundles}
    finally:
        tree.close()


# ---------------------------------------------------------------- every bundle


def check_drift(lay: Layout, bundles: list[Bundle], probes: dict[str, list[str]],
                package: str = "sglang") -> dict[str, dict[str, Any]]:
    """{bundle id: drift} (the ``drift`` key of its bundle.json)."""
    try:
        index = fetch_index(lay.cache, package)
    except HarnessError as exc:
        return {b.id: {"status": NOT_CHECKED, "reason": str(exc)} for b in bundles}
    url = index.get("_url")
    newer = {b.id: releases_after(index, b.base_release, package) for b in bundles}
    drift = {b.id: {"status": BEHIND if newer[b.id] else CURRENT, "index": url,
                    "base_release": b.base_release, "releases": {}} for b in bundles}
    for v in sorted({v for vs in newer.values() for v in vs}, key=version_key):
        behind = [b for b in bundles if v in newer[b.id]]
        for bid, cell in release_cells(lay, index, v, behind, probes, package).items():
            drift[bid]["releases"][v] = cell
    return drift


def record(bundles: list[Bundle], drift: dict[str, dict[str, Any]]) -> None:
    for b in bundles:
        path = b.dir / "bundle.json"
        meta = json.loads(path.read_text())
        meta["drift"] = drift[b.id]
        path.write_text(json.dumps(meta, indent=2) + "\n")


# ---------------------------------------------------------------- output


def render(drift: dict[str, dict[str, Any]], package: str = "sglang") -> list[str]:
    """The lines ``pr-export`` prints (all start with ``drift:``)."""
    if not drift:
        return []
    reasons = {d["reason"] for d in drift.values() if d["status"] == NOT_CHECKED}
    lines = [f"drift: not checked: {r}" for r in sorted(reasons)]
    by_base: dict[str, list[str]] = {}
    for bid, d in drift.items():
        if d["status"] != NOT_CHECKED:
            by_base.setdefault(d["base_release"], []).append(bid)
    for base, ids in sorted(by_base.items()):
        lines += _render_base(package, base, {i: drift[i] for i in ids}, len(ids) == len(drift))
    return lines


def _render_base(package: str, base: str, drift: dict[str, dict[str, Any]], every: bool) -> list[str]:
    url = next(iter(drift.values()))["index"]
    current = [i for i, d in drift.items() if d["status"] == CURRENT]
    lines = []
    if current:
        who = "bundles are current" if every and len(current) == len(drift) else ", ".join(current) + " current"
        lines.append(f"drift: no {package} release after {base} on {url}; {who}")
    behind = {i: d for i, d in drift.items() if d["status"] == BEHIND}
    if behind:
        versions = list(dict.fromkeys(v for d in behind.values() for v in d["releases"]))
        lines.append(f"drift: {package} release(s) after {base} on {url}: {', '.join(versions)}")
        lines += [f"drift:   {i} on {v}: {cell_line(c)}" for i, d in behind.items() for v, c in d["releases"].items()]
    return lines


def cell_line(cell: dict[str, Any]) -> str:
    if cell["status"] == NOT_CHECKED:
        return f"not checked: {cell['reason']}"
    applied = cell["apply"]
    text = "applies" if applied["ok"] else (
        f"conflicts in {', '.join(applied['files']) or '?'}: " + "; ".join(applied["problems"]))
    if cell["status"] == "landed":
        return f"landed (Upstream-Probe {', '.join(cell['probes'])} finds it); git apply: {text}"
    return text


# ---------------------------------------------------------------- entry points


def report_drift(lay: Layout, dirs: list[Path], probes: dict[str, list[str]]) -> dict[str, Any]:
    """Check, record in each bundle.json and print. Never raises for the index, a wheel or
    a bundle: drift is information (one ``drift: not checked: ...`` line instead)."""
    if not dirs:
        return {}
    try:
        bundles = [load_bundle(d) for d in dirs]
        package = load_pin(lay).get("package", "sglang")
        drift = check_drift(lay, bundles, probes, package)
        record(bundles, drift)
    except (HarnessError, OSError, ValueError, KeyError) as exc:
        progress(f"drift: not checked: {exc}")
        return {}
    for line in render(drift, package):
        progress(line)
    return drift
