"""``pr-export``: one upstream PR bundle per upstream-bound patch.

For every patch with ``Forwarded: yes`` that the newest SGLang release does not already
carry (see ``upstream-status``), write ``build/pr/<patch-id>/``:

* ``NNNN-*.patch``: the patch rebased onto the newest release it applies to (its series
  prefix, minus what that release already has, applied first in a temp repo of that
  release's tree), with an upstream-style unit test folded in, as ``git format-patch``
  output. Our own trailers (Patch-Id, Drop-In, ...) are stripped from the upstream commit.
* ``deps/*.patch``: prefix patches that release lacks (their own PRs must land first).
* ``title.txt``, ``description.md`` (motivation, change, test evidence from the last
  harness run: ``build/results/ablation.json``, ``build/results/bench/memory.md``; else
  "not run"), ``PUSH.md`` (exact ``git am`` + ``git push`` commands), ``bundle.json``.

The unit test comes from ``harness/upstream/templates/<patch-id>.py`` (SGLang layout:
``test/registered/...``, ``register_cpu_ci``/``register_cuda_ci`` markers, unittest,
runnable as ``python3 file.py``); its destination path is declared in the template's
``# upstream-path:`` header line.

On another base (``make pr-export`` uses the newest one, ``patches/<version>/``; see
:func:`export_from_base`) the bundles are built from that base's own series instead:
each patch goes onto the pristine release alone (its series exists because that
release lacks it, so nothing upstream already has rides along), the template for that
base (``templates/<version>/<patch-id>.py``) is folded in, and the bundle is verified:
the bundle's patch passes ``git apply --check`` on the pristine release tree, and its
test fails there and passes with the patch; ``description.md`` shows both runs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from harness import HarnessError, progress
from harness.patchset.git import git
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin
from harness.patchset.scratch import scratch
from harness import zygote
from harness.upstream import blame, bundles, prbody
from harness.upstream.prbody import fork_paths, strip_trailers

TEMPLATES = Path(__file__).resolve().parent / "templates"
PUSH_REF = "refs/heads/auxcap/{id}"
DEFAULT_TEST_DIR = "test/registered/spec"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--versions", nargs="+", metavar="V",
                   help="releases to consider (default: every release after the pin)")
    p.add_argument("--status-json", type=Path, metavar="PATH",
                   help="reuse an upstream-status --json report instead of recomputing it")
    p.add_argument("--only", nargs="+", metavar="ID", help="only these patch ids")
    p.add_argument("--remote", default="<remote>", help="remote name for the push command")
    p.add_argument("--out", type=Path, help="output dir (default: build/pr)")
    p.add_argument("--max-depth", type=int, metavar="N",
                   help="refuse a stack of bundles deeper than N PRs (default: max_depth in the "
                        "base's bundles.toml; unset there, refuse nothing)")


def run(args: argparse.Namespace) -> int:
    lay = layout()
    written = pr_export(lay, versions=args.versions, status_json=args.status_json,
                        only=args.only, remote=args.remote, out=args.out, max_depth=args.max_depth)
    if not written:
        progress("no bundles: every forwarded patch has landed upstream (or none is forwarded)")
    return 0


# ---------------------------------------------------------------- helpers


def write_stack(lay: Layout, out: Path, units: list, max_depth: int | None) -> dict:
    """``out/stack.json``: each bundle in ``out`` (its ``bundle.json``) -> the bundles it
    stacks on (those holding its ``deps``), each one's depth and longest chain. Refuses a
    chain deeper than ``max_depth`` in one line naming it."""
    owner = {pid: u.id for u in units for pid in u.ids}
    current = {u.id for u in units}
    needs: dict[str, list[str]] = {}
    for meta_file in sorted(out.glob("*/bundle.json")):
        meta = json.loads(meta_file.read_text())
        if meta["id"] not in current:  # a bundle the series no longer has
            continue
        needs[meta["id"]] = sorted({owner.get(d, d) for d in meta["deps"]} - {meta["id"]})
    for deps in list(needs.values()):  # a dep whose bundle is not in out: a leaf here
        for d in deps:
            needs.setdefault(d, [])
    graph = bundles.stack(needs)
    (out / "stack.json").write_text(json.dumps(graph, indent=2) + "\n")
    progress(f"stack: {len(needs)} bundles, deepest chain {graph['max_depth']} PRs "
             f"({' -> '.join(graph['deepest'])}); {lay.rel(out / 'stack.json')}")
    if max_depth is not None and graph["max_depth"] > max_depth:
        raise HarnessError(f"stack: {graph['deepest'][-1]} stacks {graph['max_depth']} PRs deep "
                           f"({' -> '.join(graph['deepest'])}), over --max-depth {max_depth}")
    return graph


def template_for(patch_id: str, base: str | None = None) -> tuple[str, str] | None:
    """(upstream path, source) of the PR unit test for ``patch_id`` on ``base`` (None: the
    pin's, in ``templates/``; another base's in ``templates/<base>/``), or None."""
    path = (TEMPLATES if base is None else TEMPLATES / base) / f"{patch_id.replace('-', '_')}.py"
    if not path.exists():
        return None
    text = path.read_text()
    m = re.search(r"^# upstream-path:\s*(\S+)\s*$", text, re.M)
    dest = m.group(1) if m else f"{DEFAULT_TEST_DIR}/test_{patch_id.replace('-', '_')}.py"
    text = re.sub(r"^# upstream-path:.*\n", "", text, count=1, flags=re.M)
    return dest, text


def test_evidence(lay: Layout, patch_id: str) -> list[str]:
    """Markdown lines from the last harness run, or "not run"."""
    out: list[str] = []
    ablation = lay.results / "ablation.json"
    if ablation.exists():
        try:
            data = json.loads(ablation.read_text())
        except json.JSONDecodeError:
            data = None
        hits = _find_patch_entries(data, patch_id)
        if hits:
            out.append(f"Ablation ({lay.rel(ablation)}): results for `{patch_id}`:")
            out.append("")
            out.append("```json")
            out.append(json.dumps(hits, indent=2, sort_keys=True)[:4000])
            out.append("```")
        else:
            out.append(f"Ablation ({lay.rel(ablation)}): no entry for `{patch_id}`.")
    else:
        out.append("Ablation (each regression test fails without the patch): not run.")
    memory = lay.results / "bench" / "memory.md"
    out.append("")
    if memory.exists():
        text = memory.read_text().strip()
        out.append(f"Memory benchmark ({lay.rel(memory)}):")
        out.append("")
        out.extend(text.splitlines()[:60])
    else:
        out.append("Memory benchmark (list+cat vs packer peak bytes): not run.")
    return out


def _find_patch_entries(data: Any, patch_id: str) -> Any:
    if isinstance(data, dict):
        if patch_id in data:
            return {patch_id: data[patch_id]}
        found = {k: _find_patch_entries(v, patch_id) for k, v in data.items()}
        found = {k: v for k, v in found.items() if v}
        if found:
            return found
        if any(v == patch_id for v in data.values() if isinstance(v, str)):
            return data
        return None
    if isinstance(data, list):
        found = [x for x in (_find_patch_entries(v, patch_id) for v in data) if x]
        return found or None
    return None


def _wheel_for(lay: Layout, report: dict[str, Any], version: str) -> Path:
    pin = load_pin(lay)
    if version == pin["version"]:
        from harness.patchset.apply import fetch_wheel

        return fetch_wheel(lay, pin)
    rel = next((r for r in report["releases"] if r["version"] == version), None)
    if rel is None:
        raise HarnessError(f"{version}: not in the upstream-status report")
    path = Path(rel.get("path") or lay.cache / rel["wheel"])
    if not path.exists():
        from harness.patchset.pypi import fetch_index, pick_wheel, release_wheel

        idx = fetch_index(lay.cache, pin.get("package", "sglang"))
        path = release_wheel(lay.cache, idx, pick_wheel(idx, version, pin.get("package", "sglang")))
    return path


# ---------------------------------------------------------------- main


def pr_export(
    lay: Layout,
    versions: list[str] | None = None,
    status_json: Path | None = None,
    only: list[str] | None = None,
    remote: str = "<remote>",
    out: Path | None = None,
    max_depth: int | None = None,
) -> list[Path]:
    from harness.patchset.export import FORMAT_PATCH_FLAGS
    from harness.upstream.status import (
        check_apply,
        lay_out_release,
        load_series,
        upstream_status,
    )

    if lay.base is not None:
        return export_from_base(lay, only=only, remote=remote, out=out, max_depth=max_depth)
    pin = load_pin(lay)
    patches = load_series(lay)
    if status_json:
        report = json.loads(Path(status_json).read_text())
    else:
        report = upstream_status(lay, versions)
    by_id = {p["id"]: p for p in report["patches"]}
    releases = [r["version"] for r in report["releases"]]
    newest = releases[-1] if releases else pin["version"]
    out = out or lay.build / "pr"
    written: list[Path] = []
    for idx_p, p in enumerate(patches):
        if only and p.id not in only:
            continue
        if not p.forwarded:
            progress(f"{p.id}: Forwarded: {p.trailers.get('Forwarded', '?')}; no bundle")
            continue
        info = by_id.get(p.id)
        if info is None:
            raise HarnessError(f"{p.id}: not in the upstream-status report; rerun upstream-status")
        cells = info["releases"]
        if releases and cells[newest]["status"] == "landed":
            progress(f"{p.id}: landed upstream in {info['first_landed']}; no bundle")
            continue
        target = next((v for v in reversed(releases) if cells[v]["status"] == "applies"), None)
        notes: list[str] = []
        if target is None:
            target = pin["version"]
            if releases:
                probs = cells[newest]["apply"]["problems"] if cells[newest].get("apply") else []
                notes.append(
                    f"Does not apply to any release after the pin; based on the pin {target}. "
                    f"On {newest} it conflicts: " + ("; ".join(probs) or "see upstream-status")
                    + ". Port it by hand before opening the PR."
                )
        progress(f"{p.id}: building PR bundle on sglang {target}")
        dest = out / p.id
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        tmpl = template_for(p.id)
        lay.build.mkdir(parents=True, exist_ok=True)
        with scratch(lay.build, "pr") as tmp:
            repo = Path(tmp) / "sglang"
            wheel = _wheel_for(lay, report, target)
            touched = sorted({f for q in patches[: idx_p + 1] for f in q.files})
            lay_out_release(wheel, repo, touched)
            git(repo, "tag", "release")
            deps = []
            for q in patches[:idx_p]:
                qcell = by_id.get(q.id, {}).get("releases", {}).get(target)
                if qcell and qcell["status"] == "landed":
                    continue
                res = check_apply(repo, q)
                if not res.ok:
                    raise HarnessError(f"{p.id}: prefix patch {q.name} does not apply on {target}: "
                                       + "; ".join(res.problems))
                deps.append(q)
            git(repo, "tag", "pr-base")
            am = git(repo, "am", "--keep-cr", "--no-3way", "--committer-date-is-author-date", str(p.path), check=False)
            if am.returncode != 0:
                git(repo, "am", "--abort", check=False)
                raise HarnessError(f"{p.id}: git am of {p.name} failed on {target}")
            test_path = None
            if tmpl:
                test_path, test_src = tmpl
                tp = repo / test_path
                tp.parent.mkdir(parents=True, exist_ok=True)
                tp.write_text(test_src)
                git(repo, "add", "-f", test_path)
                (dest / "upstream_test.py").write_text(test_src)
            msg = p.subject + "\n\n" + strip_trailers(p.body) + "\n"
            (Path(tmp) / "msg").write_text(msg)
            git(repo, "commit", "-q", "--amend", "--no-verify", "-F", str(Path(tmp) / "msg"))
            pf = git(repo, *FORMAT_PATCH_FLAGS, "-o", str(dest), "pr-base..HEAD").stdout.split()
            if deps:
                git(repo, *FORMAT_PATCH_FLAGS, "-o", str(dest / "deps"), "release..pr-base")
            stat = git(repo, "diff", "--stat", "pr-base..HEAD").stdout.rstrip()
        patch_names = [Path(x).name for x in pf]
        title = p.subject
        (dest / "title.txt").write_text(title + "\n")
        desc = _description(lay, p, target, test_path, deps, notes, stat, info)
        (dest / "description.md").write_text(desc)
        push = _push(p.id, target, patch_names, deps, remote, test_path)
        (dest / "PUSH.md").write_text(push)
        (dest / "bundle.json").write_text(json.dumps({
            "id": p.id, "title": title, "base_release": target, "base_tag": f"v{target}",
            "patches": patch_names, "deps": [q.id for q in deps], "test": test_path,
            "branch": PUSH_REF.format(id=p.id), "notes": notes,
        }, indent=2) + "\n")
        progress(f"  wrote {lay.rel(dest)} ({', '.join(patch_names)})")
        written.append(dest)
    return written


def _description(lay, p, target, test_path, deps, notes, stat, info) -> str:
    origin = p.trailers.get("Origin", "new")
    lines = [f"# {p.subject}", ""]
    if notes:
        lines += ["> " + n for n in notes] + [""]
    body = strip_trailers(p.body)
    lines += ["## Motivation", "", body.split("\n\nFix:")[0].strip(), ""]
    lines += ["## Change", ""]
    change = prbody.section(body, "Fix")
    if change:
        lines += [change, ""]
    lines += [f"Based on SGLang v{target}. Files:", "", "```", stat, "```", ""]
    if origin.startswith("new, port of"):
        lines += [f"Port of {origin.split('port of', 1)[1].strip()}.", ""]
    if deps:
        lines += ["Depends on (apply/merge first): " + ", ".join(f"`{q.id}`" for q in deps), ""]
    lines += ["## Tests", ""]
    if test_path:
        lines += [f"- New unit test `{test_path}` (registered for CI; runs as `python3 {test_path}`)."]
    else:
        lines += ["- No upstream unit test template for this patch (harness/upstream/templates/)."]
    lines += ["", "### Evidence from the auxcap regression harness", ""]
    lines += test_evidence(lay, p.id)
    first = info.get("first_landed")
    lines += ["", f"Upstream status (auxcap upstream-status): first landed: {first or 'not yet'}."]
    return "\n".join(lines).rstrip() + "\n"


def _push(pid, target, patch_names, deps, remote, test_path) -> str:
    ref = PUSH_REF.format(id=pid)
    lines = [
        f"# Push `{pid}` as an upstream branch", "",
        "In a clone of https://github.com/sgl-project/sglang:", "", "```sh",
        f"git fetch origin tag v{target}",
        f"git checkout -b auxcap/{pid} v{target}",
    ]
    if deps:
        lines.append(f"git am --no-3way build/pr/{pid}/deps/*.patch   # prefix: {', '.join(q.id for q in deps)}")
    lines += [f"git am --no-3way build/pr/{pid}/{n}" for n in patch_names]
    if test_path:
        lines.append(f"python3 {test_path}")
    lines += [f"git push {remote} HEAD:{ref}", "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- from another base

TEST_TIMEOUT = 600  # seconds for one run of a bundle's unit test
TEST_SUPPORT = "python/sglang/test/"  # where a bundle's shared test code lives


def export_from_base(lay: Layout, only: list[str] | None = None, remote: str = "<remote>",
                     out: Path | None = None, max_depth: int | None = None) -> list[Path]:
    """One verified bundle per ``Forwarded: yes`` patch of this base's series, on the
    pristine release it is based on (``build/sglang-<base>`` at its base tag)."""
    from harness.patchset.pin import base_tag
    from harness.upstream.status import load_series

    pin = load_pin(lay)
    release = pin["version"]
    if not (lay.tree / ".git").exists():
        raise HarnessError(f"{lay.rel(lay.tree)}: no tree of {release}; run `make apply-patches BASE={release}` first")
    tag = base_tag(pin)
    if git(lay.tree, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check=False).returncode != 0:
        raise HarnessError(f"{lay.rel(lay.tree)}: no tag {tag}; rebuild it with `make apply-patches BASE={release} FORCE=1`")
    patches = load_series(lay)
    units = bundles.load(TEMPLATES / lay.base, patches)
    if max_depth is None:
        max_depth = bundles.max_depth(TEMPLATES / lay.base)
    out = out or lay.build / "pr"
    written: list[Path] = []
    lock = _lock_trees(lay)  # noqa: F841 (held until this function returns)
    with scratch(lay.build, "pr-lines") as tmp_lines:
        lines = blame.SeriesLines.build(_pristine_clone(lay.tree, tag, Path(tmp_lines) / "series"), tag, patches)
        for u in units:
            if _selected(u, only):
                dest = _export_unit(lay, u, units, patches, lines, release, tag, out, remote)
                if dest is not None:
                    written.append(dest)
    if not only:
        _remove_stale(lay, out, units, release)
    if written:
        write_stack(lay, out, units, max_depth)
        # With --only, the bundles not rebuilt are checked too: a new patch can break an
        # earlier bundle's test on the whole series (its template, as the bundle carries it).
        others = [(u.id, *t) for u in units if only and not _selected(u, only)
                  and u.forwarded and (t := template_for(u.id, lay.base)) is not None]
        _verify_on_whole_series(lay, written, release, others)
    # Information, not a gate: does each bundle still apply to the releases after its base?
    from harness.upstream.drift import report_drift

    report_drift(lay, written, {p.id: p.probes for p in patches})
    return written


def _remove_stale(lay: Layout, out: Path, units: list, release: str) -> None:
    """Remove the bundles of this base's release in ``out`` that no unit of the series
    writes any more (a renamed or dropped bundle); another base's stay."""
    ids = {u.id for u in units}
    for meta_file in sorted(out.glob("*/bundle.json")):
        meta = json.loads(meta_file.read_text())
        if meta.get("base_release") == release and "members" in meta and meta.get("id") not in ids:
            shutil.rmtree(meta_file.parent)
            progress(f"removed {lay.rel(meta_file.parent)}: the {release} series has no bundle {meta.get('id')}")


def _export_unit(lay: Layout, u, units: list, patches: list, lines, release: str, tag: str, out: Path,
                 remote: str) -> Path | None:
    """One unit's bundle in ``out/<id>``, verified (see :func:`export_from_base`); None for
    a unit not forwarded."""
    from harness.patchset.export import FORMAT_PATCH_FLAGS

    for m in u.members:  # a member's own bundle from before it was grouped
        if m.id != u.id and (out / m.id).exists():
            shutil.rmtree(out / m.id)
            progress(f"  removed {lay.rel(out / m.id)}: {m.id} goes upstream in {u.id}")
    if not u.forwarded:
        progress(f"{u.id}: Forwarded: {u.trailers.get('Forwarded', '?')}; no bundle")
        if (out / u.id).exists():  # written while it was forwarded: not a PR now
            shutil.rmtree(out / u.id)
            progress(f"  removed {lay.rel(out / u.id)}, its earlier bundle")
        return None
    tmpl = template_for(u.id, lay.base)
    if tmpl is None:
        raise HarnessError(f"{u.members[0].name}: no upstream test template "
                           f"harness/upstream/templates/{lay.base}/{u.id.replace('-', '_')}.py")
    test_path, test_src = tmpl
    body = u.body(test_path)
    leaked = fork_paths(body)
    if leaked:
        raise HarnessError(f"{u.members[0].name}: the upstream body names fork paths outside its "
                           f"Fork-Testing: paragraph: {', '.join(leaked)}")
    progress(f"{u.id}: building PR bundle on sglang {release}"
             + (f" ({' + '.join(u.ids)})" if u.grouped else ""))
    dest = out / u.id
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    last = patches.index(u.members[-1])
    prefix = [q for q in patches[:last] if q.id not in set(u.ids)]
    with scratch(lay.build, "pr") as tmp:
        repo = _pristine_clone(lay.tree, tag, Path(tmp) / "sglang")
        deps, deps_from = _apply_alone_or_with_prefix(
            repo, u, prefix, release,
            lambda q: bundles.needed_patches(units, bundles.unit_of(units, q.id)),
            lines, lambda q: bundles.unit_of(units, q.id).members)
        n = len(u.members)
        git(repo, "tag", "pr-base", f"HEAD~{n}")  # below the patch, above its deps
        if n > 1:  # one commit: the first member's, holding them all
            git(repo, "reset", "-q", "--soft", f"HEAD~{n - 1}")
        (repo / test_path).parent.mkdir(parents=True, exist_ok=True)
        (repo / test_path).write_text(test_src)
        git(repo, "add", "-f", test_path)
        (Path(tmp) / "msg").write_text(u.subject + "\n\n" + body + "\n")
        git(repo, "commit", "-q", "--amend", "--no-verify", "-F", str(Path(tmp) / "msg"))
        pf = [Path(x) for x in git(repo, *FORMAT_PATCH_FLAGS, "-o", str(dest), "pr-base..HEAD").stdout.split()]
        if deps:
            git(repo, *FORMAT_PATCH_FLAGS, "-o", str(dest / "deps"), f"{tag}..pr-base")
        stat = git(repo, "diff", "--stat", "pr-base..HEAD").stdout.rstrip()
        # Test code the bundle adds beside its test (a shared scaffold under
        # python/sglang/test/) goes into the run without the change too: that run
        # is the change's tests on the release's code, so it fails on the bug,
        # not on a missing import.
        support = [x for x in git(repo, "diff", "--name-only", "--diff-filter=A", "pr-base..HEAD", "--",
                                  TEST_SUPPORT).stdout.split() if x != test_path]
        # Verify on fresh pristine trees, as a reviewer would: apply --check, then
        # the test without the patch (must fail) and with it (must pass). The two
        # runs are independent (each a fork that imports SGLang from its own tree:
        # harness.zygote), so they go side by side on two trees.
        without_tree, with_tree = (_test_tree(lay, name, tag) for name in ("without", "with"))
        for tree in (without_tree, with_tree):
            for d in sorted((dest / "deps").glob("*.patch")) if deps else []:
                git(tree, "am", "--keep-cr", "--no-3way", str(d))
        applied = git(with_tree, "apply", "--check", *map(str, pf), check=False)
        if applied.returncode != 0:
            raise HarnessError(f"{u.id}: bundle patch {pf[0].name} does not apply to pristine {release}: "
                               + (applied.stderr.strip().splitlines() or ["git apply --check failed"])[0])
        git(with_tree, "apply", *map(str, pf))  # adds the test too
        (without_tree / test_path).parent.mkdir(parents=True, exist_ok=True)
        (without_tree / test_path).write_text(test_src)
        for rel in support:
            (without_tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (without_tree / rel).write_text((repo / rel).read_text())
        logs = [Path(tmp) / f"{name}.log" for name in ("without", "with")]
        _settle()
        statuses = zygote.shared(TEST_TIMEOUT).run([(without_tree, test_path, logs[0]), (with_tree, test_path, logs[1])])
        without, with_patch = (_test_result(rc, log, tree) for rc, log, tree
                               in zip(statuses, logs, (without_tree, with_tree)))
    what = " + ".join(m.name for m in u.members)
    if without["rc"] == 0:
        raise HarnessError(f"{u.id}: {test_path} passes on pristine {release} without {what}: "
                           "it does not test the bug")
    if with_patch["rc"] != 0:
        hint = ("; it has the PRs whose lines it reads: name one it needs otherwise in bundles.toml [needs]"
                if deps_from == "lines" else "")
        raise HarnessError(f"{u.id}: {test_path} fails on {release} with {what}: {with_patch['last']}{hint}")
    (dest / "upstream_test.py").write_text(test_src)
    patch_names = [f.name for f in pf]
    (dest / "title.txt").write_text(u.subject + "\n")
    dep_units = [x for x in units if set(x.ids) & {q.id for q in deps}]
    desc = prbody.base_description(u, release, test_path, dep_units, stat, without, with_patch, body)
    leaked = prbody.fork_markers(desc + "\n" + body)
    if leaked:
        raise HarnessError(f"{u.id}: the PR body carries the fork's {', '.join(leaked)}")
    (dest / "description.md").write_text(desc)
    (dest / "PUSH.md").write_text(_push(u.id, release, patch_names, deps, remote, test_path))
    (dest / "bundle.json").write_text(json.dumps({
        "id": u.id, "title": u.subject, "base_release": release, "base_tag": f"v{release}",
        "members": u.ids, "patches": patch_names, "deps": [q.id for q in deps],
        "deps_from": deps_from.split(" ", 1)[0], "test": test_path,
        "branch": PUSH_REF.format(id=u.id), "notes": [],
        "verified": {"apply_check": "ok", "test_without_patch": without["summary"],
                     "test_with_patch": with_patch["summary"]},
    }, indent=2) + "\n")
    progress(f"  wrote {lay.rel(dest)} ({', '.join(patch_names)}); test fails without, passes with; "
             f"{len(deps)} deps by {deps_from}")
    return dest


def _selected(u, only: list[str] | None) -> bool:
    """``--only``: a unit is asked for by its own id or by one of its patches'."""
    return not only or u.id in only or bool(set(u.ids) & set(only))


def _verify_on_whole_series(lay: Layout, written: list[Path], release: str,
                            others: list[tuple[str, str, str]] = ()) -> None:
    """Each bundle's test must also pass on the whole series (a clean checkout of the
    tree's HEAD): merged upstream in series order, a later PR must not break an earlier
    one's test (e.g. a packer family turning a list another test indexes into one
    tensor). ``others``: (id, test path, source) of bundles not rebuilt this run
    (``--only``), checked the same way. Two runs at a time, on one tree; the result goes
    into bundle.json."""
    metas = [json.loads((d / "bundle.json").read_text()) for d in written]
    sources = [(d / "upstream_test.py").read_text() for d in written]
    for pid, test_path, src in others:
        metas.append({"id": pid, "test": test_path})
        sources.append(src)
    progress(f"checking {len(metas)} bundle test(s) on the whole {release} series"
             + (f" ({len(others)} of bundles not rebuilt)" if others else ""))
    with scratch(lay.build, "pr") as tmp:
        tree = _test_tree(lay, "with", git(lay.tree, "rev-parse", "HEAD").stdout.strip())
        for meta, src in zip(metas, sources):
            (tree / meta["test"]).parent.mkdir(parents=True, exist_ok=True)
            (tree / meta["test"]).write_text(src)
        results = []
        _settle()
        for i in range(0, len(metas), 2):
            pair = metas[i:i + 2]
            logs = [Path(tmp) / f"{m['id']}.log" for m in pair]
            statuses = zygote.shared(TEST_TIMEOUT).run([(tree, m["test"], log) for m, log in zip(pair, logs)])
            results += [_test_result(rc, log, tree) for rc, log in zip(statuses, logs)]
    failed = [(m, r) for m, r in zip(metas, results) if r["rc"] != 0]
    for d, meta, res in zip(written, metas, results):
        meta["verified"]["test_on_whole_series"] = res["summary"]
        (d / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    if failed:
        raise HarnessError("; ".join(f"{m['id']}: {m['test']} fails on the whole {release} series "
                                     f"(the later patches applied): {_first_error(r)}" for m, r in failed))
    progress(f"  every bundle's test passes on the whole {release} series too")


def _first_error(res: dict[str, Any]) -> str:
    """The line of a failed run's log that says what went wrong, else its last."""
    return next((x.strip() for x in res["tail"] if "Error" in x), res["last"])


def _pristine_clone(tree: Path, tag: str, dest: Path) -> Path:
    """A throwaway checkout of ``tag`` that shares ``tree``'s objects."""
    git(dest.parent, "clone", "-q", "--shared", "--no-checkout", str(tree), str(dest))
    git(dest, "checkout", "-q", "-b", "pr", tag)
    return dest


def _test_tree(lay: Layout, name: str, rev: str) -> Path:
    """``build/pr-trees[-<base>]/<name>``, a checkout of ``rev`` (sharing ``lay.tree``'s
    objects) with every local change and untracked file removed. The tree stays between
    bundles and between runs: a bundle rewrites only the files its patches touch, so the
    other modules' compiled bytecode (keyed by path, checked by mtime and size) stays
    valid and a test run imports SGLang without compiling it again (about 15 s a run on
    2 cores). One pr-export at a time uses the trees (:func:`_lock_trees`)."""
    tree = lay.pr_trees / name
    if not (tree / ".git").exists():
        if tree.exists():
            shutil.rmtree(tree)
        tree.parent.mkdir(parents=True, exist_ok=True)
        git(tree.parent, "clone", "-q", "--shared", "--no-checkout", str(lay.tree), str(tree))
    git(tree, "am", "--abort", check=False)
    git(tree, "fetch", "-q", "--tags", str(lay.tree), "+HEAD:refs/auxcap/series")
    git(tree, "checkout", "-q", "-f", "--detach", rev)
    git(tree, "clean", "-q", "-f", "-d", "-x")
    return tree


def _settle() -> None:
    """Wait into the next second of the clock before a run on a test tree. A compiled
    module is reused while its source's size and mtime (whole seconds) are unchanged;
    the trees are rewritten between runs, so a file rewritten with the same size in
    the second its last compiled version was written would load stale bytecode. Every
    write to a tree happens before this wait and every compile after it, so each
    compiled version's second is earlier than any later rewrite's."""
    import time

    now = time.time()
    time.sleep(int(now) + 1 - now + 0.05)


def _lock_trees(lay: Layout):
    """Hold ``build/pr-trees[-<base>]/.lock`` for this process (one pr-export at a time
    on those trees); another holder is a one-line error."""
    import fcntl

    lay.pr_trees.mkdir(parents=True, exist_ok=True)
    fh = open(lay.pr_trees / ".lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise HarnessError(f"{lay.rel(lay.pr_trees)} is in use by another pr-export; wait for it to finish")
    return fh


def _walk(prefix: list, files: set[str], want: set[str], needs_of) -> list:
    """The prefix patches a unit needs, in series order: walking back from the unit,
    each one named in ``want`` or touching a file of the unit or of a patch already
    taken; a taken patch adds its files and the units it needs (``needs_of``) to what
    the walk takes further back. A patch between them and the unit that touches only
    files of patches before it is not needed (another packer family never is: two
    families of the same migration do not depend on each other)."""
    files, want, taken = set(files), set(want), []
    for q in reversed(prefix):
        if q.id in want or files & set(q.files):
            taken.append(q)
            files |= set(q.files)
            want |= {n.id for n in needs_of(q)}
    return taken[::-1]


def _by_lines(start: list, prefix: list, lines, needs_of, members_of) -> list:
    """The prefix patches ``start`` reads (:class:`blame.SeriesLines`): those that wrote a
    line their hunks change or keep as context, and what those read in turn; a prefix
    patch taken brings its whole unit (a PR merges whole) and the units its unit needs
    (``start``'s own units are the caller's to add). In series order."""
    allowed = {q.id for q in prefix}
    seen: set[str] = set()
    todo = list(start)
    while todo:
        q = todo.pop()
        if q.id in seen:
            continue
        seen.add(q.id)
        todo += lines.read_by(q)
        if q.id in allowed:
            todo += [*members_of(q), *needs_of(q)]
    return [q for q in prefix if q.id in seen]


def _apply_alone_or_with_prefix(repo: Path, u, prefix: list, release: str, needs_of=lambda q: [],
                                lines=None, members_of=lambda q: [q]) -> tuple[list, str]:
    """``git am`` the unit's patches on the pristine release, after the units it needs
    (``needs_of(patch)``: :func:`bundles.needed_patches` of its unit) and what those
    need (with ``lines``, :func:`_by_lines`: what they read; else :func:`_walk`: every
    earlier patch on their files); when that does not apply, after the earlier patches it
    reads and they need (with ``lines``); when that does not apply either, after every
    earlier patch on its files (:func:`_walk`: those that overlap it, and what they
    need). ``prefix``: the series before the unit's last patch, without its own. Returned: the bundle's deps/,
    in series order, and how they were found ("needs", "lines", or "files" with the
    reason the lines were not enough)."""
    def am(patches: list) -> str | None:
        for q in patches:
            if git(repo, "am", "--keep-cr", "--no-3way", str(q.path), check=False).returncode != 0:
                git(repo, "am", "--abort", check=False)
                return q.name
        return None

    needed = [n for m in u.members for n in needs_of(m)]
    want = {n.id for n in needed}
    try:
        forced = None if lines is None else _by_lines(needed, prefix, lines, needs_of, members_of)
    except blame.Unreadable:
        forced = None
    if forced is None:
        forced = _walk(prefix, set(), want, needs_of) if want else []
    start = git(repo, "rev-parse", "HEAD").stdout.strip()
    failed = am(forced)
    if failed and lines is None:
        raise HarnessError(f"{u.id}: prefix patch {failed} does not apply on {release}")
    if not failed and am(u.members) is None:
        return forced, "needs"
    git(repo, "reset", "-q", "--hard", start)
    how = "files"
    if lines is not None:
        try:
            read = _by_lines([*u.members, *needed], prefix, lines, needs_of, members_of)
        except blame.Unreadable as e:
            how = f"files (the lines it reads cannot be told: {e})"
        else:
            failed = am(read) or am(u.members)
            if failed is None:
                return read, "lines"
            how = f"files (on the patches it reads, {failed} does not apply)"
            git(repo, "reset", "-q", "--hard", start)
    deps = _walk(prefix, set(u.files), want, needs_of)
    failed = am(deps)
    if failed:
        raise HarnessError(f"{u.id}: prefix patch {failed} does not apply on {release}")
    failed = am(u.members)
    if failed:
        raise HarnessError(f"{u.id}: {failed} does not apply on {release}, alone or after its series prefix")
    return deps, how


def _test_result(rc: int, log: Path, tree: Path) -> dict[str, Any]:
    """A run's status and the lines of its log a reader needs. Paths are the reviewer's:
    relative to the SGLang checkout, installed packages from ``site-packages/``; never
    this machine's (``tree``: the checkout the test ran in)."""
    output = (f"timed out after {TEST_TIMEOUT}s\n" if rc == 124 else "") + log.read_text(errors="replace")
    output = re.sub(r'"[^"\n]*/site-packages/', '"site-packages/', output.replace(f"{tree.resolve()}/", "").replace(f"{tree}/", ""))
    # The runner's own frame (it runs the test as __main__) and the line it quotes.
    output = re.sub(r'(?m)^\s*File "[^"\n]*/harness/zygote\.py".*\n(?:\s{4,}\S.*\n)?', "", output)
    lines = [x for x in output.strip().splitlines() if x.strip()]
    tail = [x for x in lines if not x.lstrip().startswith(("warnings.warn", "/"))][-12:]
    summary = next((x for x in reversed(lines) if x.startswith(("OK", "FAILED", "Ran "))), f"exit {rc}")
    return {"rc": rc, "tail": tail, "summary": summary.strip(), "last": tail[-1] if tail else f"exit {rc}"}
