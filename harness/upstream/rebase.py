"""``rebase --to X``: port the series to SGLang release X as a new base; ``--promote X``
makes that base the pin once its tests are green.

Moving the pin is the same machinery as the second base (README, "Moving the pin"):

1. A new base. Read X from the index: wheel sha256s (cp311 + cp312 manylinux x86_64),
   download and verify the cp311 wheel, compute ``source_tree_sha256`` and write
   ``patches/X/pin.json``. The git commit of tag ``vX`` cannot be checked from here:
   ``git.commit`` is left null with ``git.commit_status: "unverified"`` (a git-source
   build then fails loudly until set).
2. Drop what landed: every patch of the current series whose static probe says X
   already has it is left out of ``patches/X/series``. Patches without a probe are kept.
3. Port the rest: build ``build/sglang-X`` on X (pristine commit tagged ``base/vX``,
   branch ``patched``) and ``git am`` the kept patches (offsets allowed, no fuzz, no
   3-way). On the first conflict it stops, on purpose, with the ``git am`` session
   open, the hunks that do apply applied and ``*.rej`` files for the rest, and prints
   what to do: resolve, ``git am --continue``, then ``make export-patches BASE=X``. On
   success it exports ``patches/X/`` right away. The pin and its series are untouched.
4. Tests green: ``make test BASE=X`` (the stand-ins for X's internals live in
   ``harness.standins.v<X>``), ``make ablation BASE=X``. Then ``--promote X`` checks
   that the last ``make test BASE=X`` passed after the series last changed, and moves
   ``patches/X/`` over the pin's series and ``build/*-X`` over ``build/*``.

``--dry-run`` does steps 1-3 in a scratch dir and changes nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from harness import HarnessError, progress
from harness.patchset import apply as patchset
from harness.patchset import scratch
from harness.patchset.git import git
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin, write_pin
from harness.patchset.series import parse_series, series_id

UNVERIFIED = "unverified"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--to",
        metavar="X",
        default=os.environ.get("SGLANG_VERSION") or os.environ.get("HARNESS_SGLANG_VERSION"),
        help="target SGLang release, e.g. 0.5.23 (env SGLANG_VERSION / HARNESS_SGLANG_VERSION)",
    )
    p.add_argument("--dry-run", action="store_true", help="report only; change nothing")
    p.add_argument("--force", action="store_true",
                   help="replace an existing patches/X and build/sglang-X")
    p.add_argument("--promote", action="store_true",
                   help="make base X (already ported, tests green) the pin")


def run(args: argparse.Namespace) -> int:
    lay = layout()
    if not args.to:
        raise HarnessError("rebase: no target release; pass --to X (make rebase SGLANG_VERSION=X)")
    if args.promote:
        promote(lay, args.to)
        return 0
    result = rebase(lay, args.to, dry_run=args.dry_run, force=args.force)
    return 0 if result["status"] in ("ok", "dry-run ok") else 1


def new_pin(lay: Layout, old: dict[str, Any], index: dict[str, Any], version: str) -> tuple[dict[str, Any], Path]:
    from harness.patchset.apply import extract_wheel_tree
    from harness.patchset.pypi import pick_wheel, release_files, release_wheel

    package = old.get("package", "sglang")
    entry = pick_wheel(index, version, package)
    wheel = release_wheel(lay.cache, index, entry)
    wheels: dict[str, dict[str, str]] = {}
    for f in release_files(index, package).get(version, []):
        n = f["filename"]
        if (n.endswith("x86_64.whl") and "manylinux" in n and not f.get("yanked")
                and ("-cp311-cp311-" in n or "-cp312-cp312-" in n)):
            wheels[n] = {"sha256": f["hashes"]["sha256"]}
    wheels.setdefault(entry["filename"], {"sha256": entry["hashes"]["sha256"]})
    lay.build.mkdir(parents=True, exist_ok=True)
    with scratch.scratch(lay.build, "rebase-hash") as tmp:
        tree_sha = extract_wheel_tree(wheel, Path(tmp))
    released = (entry.get("upload-time") or "")[:10] or old.get("released")
    git_info = dict(old.get("git", {}))
    git_info.update(
        tag=f"v{version}",
        commit=None,
        commit_status=f"{UNVERIFIED}: tag v{version} not resolved (GitHub unreachable when "
        "rebased); set git.commit from a trusted clone before using SGLANG_SOURCE=git",
    )
    pin = {
        "package": package,
        "version": version,
        "released": released,
        "git": git_info,
        "wheels": dict(sorted(wheels.items())),
        "source_tree_sha256": tree_sha,
    }
    return pin, wheel


def rebase(lay: Layout, version: str, dry_run: bool = False, force: bool = False) -> dict[str, Any]:
    from harness.patchset.apply import build_tree, read_state, tree_problem, write_state
    from harness.patchset.pypi import fetch_index, release_files, version_key
    from harness.upstream.probes import ZipTree, combine, run_probes
    from harness.upstream.status import load_series, parse_rejects

    old = load_pin(lay)
    package = old.get("package", "sglang")
    if version == old["version"]:
        raise HarnessError(f"the pin is already {version}")
    patches = load_series(lay)
    new = Layout(lay.root, version)  # the new base: patches/X, build/sglang-X
    if not dry_run and not force:
        if new.patches.exists():
            raise HarnessError(f"{new.rel(new.patches)}: base {version} exists already; "
                               "work on it with BASE=" + version + ", or pass --force (FORCE=1) to redo it")
        if new.tree.exists():
            problem = tree_problem(new, read_state(new))
            if problem:
                raise HarnessError(f"{problem}; run `make export-patches BASE={version}` first, or pass --force")
    index = fetch_index(lay.cache, package)
    if version not in release_files(index, package):
        raise HarnessError(f"{package} {version}: not on {index.get('_url')}")
    direction = "forward" if version_key(version) > version_key(old["version"]) else "backward"
    progress(f"rebase {package} {old['version']} -> {version} ({direction}), {len(patches)} patch(es)")
    pin, wheel = new_pin(lay, old, index, version)

    # 1. drop what X already has (static probes; never by reverse-applying our text)
    tree = ZipTree(wheel)
    keep, dropped = [], []
    try:
        for p in patches:
            results = run_probes(tree, p.probes)
            if p.probes and combine(results) is True:
                ev = "; ".join(e for r in results for e in r.evidence)
                dropped.append({"id": p.id, "file": p.name, "evidence": ev})
                progress(f"  drop {p.id} ({p.name}): landed in {version}: {ev}")
            else:
                keep.append(p)
                why = "no Upstream-Probe" if not p.probes else "probe: not in " + version
                progress(f"  keep {p.id} ({why})")
    finally:
        tree.close()

    # 2. rebuild the tree on X and git am the rest
    result: dict[str, Any] = {"from": old["version"], "to": version, "dropped": dropped,
                              "kept": [p.id for p in keep], "status": "ok", "conflict": None}
    with scratch.scratch(lay.build, "rebase") as tmp:
        work = tmp / "sglang"
        info = build_tree(new, work, pin, "wheel", [], verbose=False)
        if keep:
            am = git(work, "am", "--keep-cr", "--no-3way", "--committer-date-is-author-date",
                     *[str(p.path) for p in keep], check=False)
        else:
            am = None
        if am is not None and am.returncode != 0:
            nxt = (work / ".git" / "rebase-apply" / "next")
            n = int(nxt.read_text().strip()) if nxt.exists() else 1
            failed = keep[n - 1]
            rej = git(work, "apply", "--reject", "--verbose", str(failed.path), check=False)
            problems, files = parse_rejects(rej.stdout + rej.stderr, failed)
            if not problems:
                errs = [x for x in (am.stdout + am.stderr).splitlines() if x.startswith("error:")]
                problems = [errs[0][6:].strip() if errs else "does not apply"]
            result.update(status="conflict", conflict={
                "patch": failed.name, "id": failed.id, "problems": problems, "files": files,
                "applied": [p.id for p in keep[: n - 1]], "pending": [p.id for p in keep[n:]],
            })
        head = git(work, "rev-parse", "HEAD").stdout.strip()
        applied = keep if result["status"] == "ok" else keep[: len(result["conflict"]["applied"])]
        if dry_run:
            result["status"] = "dry-run " + result["status"]
            _report(lay, result, dry_run=True)
            return result
        # 3. write the new base: patches/X (pin.json, series, kept patches), build/sglang-X
        if new.patches.exists():
            scratch.remove_tree(new.patches)
        new.patches.mkdir(parents=True)
        write_pin(new, pin)
        header, _names = parse_series(lay.series_file.read_text())
        header = [f"# Base {version}: the series ported from {old['version']} by `make rebase "
                  f"SGLANG_VERSION={version}` (landed patches dropped)."] + [
            h for h in header if not h.startswith("# Base ")]
        new.series_file.write_text("\n".join(header + [p.name for p in keep]) + "\n")
        for p in keep:
            (new.patches / p.name).write_bytes(p.path.read_bytes())
        state = {
            "series_id": series_id(new), "source": "wheel", "pin_version": version,
            "patches": [p.name for p in applied], **info, "head": head,
        }
        if getattr(patchset, "TOOL_VERSION", None) is not None:
            state["tool"] = patchset.TOOL_VERSION
        if result["status"] != "ok":
            state["rebase_conflict"] = result["conflict"]
        write_state(new, state, work)
        if new.tree.exists():
            old_tree = scratch.aside(lay.build, f"sglang-{version}-old")
            new.tree.rename(old_tree)
            scratch.remove_tree(old_tree)
        work.rename(new.tree)
    if result["status"] == "ok":
        from harness.patchset.export import export_patches

        export_patches(new)
    _report(new, result)
    return result


def promote(lay: Layout, version: str) -> None:
    """Make base ``version`` the pin: its series replaces the pin's, its trees the pin's."""
    import xml.etree.ElementTree as ET

    if lay.base is not None:
        raise HarnessError("rebase --promote works from the pin (run it without BASE=)")
    new = Layout(lay.root, version)
    if not new.pin_file.exists():
        raise HarnessError(f"{new.rel(new.patches)}: no base {version}; run `make rebase SGLANG_VERSION={version}` first")
    junit = new.results / "junit.xml"
    if not junit.exists():
        raise HarnessError(f"base {version}: no test results ({new.rel(junit)}); run `make test BASE={version}` first")
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    bad = sum(int(suite.get(k, 0)) for k in ("failures", "errors")) if suite is not None else 1
    if bad:
        raise HarnessError(f"base {version}: the last `make test BASE={version}` had {bad} failure(s); fix them first")
    newest = max(f.stat().st_mtime for f in new.patches.iterdir())
    if junit.stat().st_mtime < newest:
        raise HarnessError(f"base {version}: {new.rel(new.patches)} changed after the last "
                           f"`make test BASE={version}`; run it again")
    old_version = load_pin(lay)["version"]
    for f in list(lay.patches.glob("*.patch")) + [lay.series_file, lay.pin_file]:
        f.unlink(missing_ok=True)
    for f in sorted(new.patches.iterdir()):
        f.rename(lay.patches / f.name)
    new.patches.rmdir()
    for kind in ("sglang", "dist", "results", "ablation"):
        src, dst = lay.build / f"{kind}-{version}", lay.build / kind
        if dst.exists():
            old_tree = scratch.aside(lay.build, f"{kind}-old")
            dst.rename(old_tree)
            scratch.remove_tree(old_tree)
        if src.exists():
            src.rename(dst)
    progress(f"promoted: the pin is {version} now (was {old_version}); patches/ holds its series")
    progress(f"tests marked bases(\"{old_version}\") no longer run: port them to {version} or delete them;")
    progress(f"the stand-ins for {version} stay in harness.standins.v{version.replace('.', '_')} (they follow the version)")


def _report(lay: Layout, result: dict[str, Any], dry_run: bool = False) -> None:
    tree = lay.rel(lay.tree)
    progress("")
    progress(f"rebase {result['from']} -> {result['to']}: "
             f"{len(result['dropped'])} dropped (landed), {len(result['kept'])} kept")
    for d in result["dropped"]:
        progress(f"  dropped {d['id']} ({d['file']})")
    if result["conflict"] is None:
        if dry_run:
            progress("dry run: every kept patch applies; nothing changed")
        else:
            progress(f"ok: base {result['to']} in {lay.rel(lay.patches)} (git commit {UNVERIFIED}); the pin is unchanged")
            progress(f"next: make test BASE={result['to']} && make ablation BASE={result['to']}, then "
                     f"make rebase SGLANG_VERSION={result['to']} PROMOTE=1 to make it the pin")
        return
    c = result["conflict"]
    progress(f"CONFLICT: {c['patch']} ({c['id']}) does not apply on {result['to']}:")
    for p in c["problems"]:
        progress(f"  {p}")
    if dry_run:
        progress("dry run: nothing changed")
        return
    progress("")
    progress(f"{tree} is left with the `git am` session open, on purpose: the hunks that apply")
    progress("are applied, the rejected ones are in *.rej files next to their targets. To finish:")
    progress(f"  cd {tree}")
    progress("  # edit the files using the .rej hunks, then remove the .rej files")
    progress("  git add -A && git am --continue      # later patches continue; repeat on the next stop")
    progress("  # (or `git am --skip` to drop this patch if upstream already has it)")
    progress(f"  cd - && make export-patches BASE={result['to']}   # writes the ported series to {lay.rel(lay.patches)}/")
    if c["pending"]:
        progress(f"still to apply after it: {', '.join(c['pending'])}")
    progress(f"{lay.rel(lay.patches)}/pin.json and series already point at {result['to']}; the pin is unchanged.")
