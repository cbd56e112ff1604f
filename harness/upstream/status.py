"""``upstream-status``: which of our patches later SGLang releases already carry.

For every patch in the series and every SGLang release after the pin (from the PEP 691
JSON simple index), report one of:

* ``landed``: the patch's static probe(s) (``Upstream-Probe:`` trailer, see
  :mod:`harness.probes`) find the change in the release's sources. Never decided by
  reverse-applying our text.
* ``applies``: still needed, and ``git apply --check`` takes it (no fuzz; git apply never
  fuzzes, offsets are allowed for releases other than the pin) on the release's tree with
  the series prefix (minus the landed patches) already applied.
* ``conflicts``: still needed, does not apply; the files and hunks are named.

The release's tree is the wheel's ``sglang/`` laid out as ``python/sglang`` in a temp git
repo; only the files the series touches are extracted (that is all ``git apply`` reads).
One wheel per release is downloaded (cp311 manylinux x86_64 preferred), sha256-checked
against the index, and cached under ``.cache/pypi/``. Nothing is installed.

Optional evidence ``--with-tests``: the patch's regression tests (``pytest --guards ID``)
run with an interpreter that has that release installed (``--test-python``); passing tests
on an unpatched release support ``landed``. Without such an interpreter: "not run".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import HarnessError, progress
from harness.patchset.git import git
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin
from harness.patchset.pypi import (
    fetch_index,
    pick_wheel,
    release_files,
    release_wheel,
    releases_after,
    version_key,
)
from harness.patchset.scratch import scratch
from harness.patchset.series import patch_files, patch_message, read_series
from harness.upstream.probes import ZipTree, combine, iter_probe_ids, run_probes

STATUSES = ("applies", "landed", "conflicts")


# ---------------------------------------------------------------- the series


@dataclass
class Patch:
    name: str
    path: Path
    text: str
    subject: str
    body: str
    trailers: dict[str, str]
    files: list[str]

    @classmethod
    def from_file(cls, path: Path, name: str | None = None) -> "Patch":
        """A ``git format-patch`` file (``name``: as the series lists it)."""
        text = path.read_text(errors="replace")
        subject, body, trailers = patch_message(text)
        return cls(name or path.name, path, text, subject, body, trailers, patch_files(text))

    @property
    def id(self) -> str:
        return self.trailers.get("Patch-Id") or self.name

    @property
    def probes(self) -> list[str]:
        return list(iter_probe_ids(self.trailers.get("Upstream-Probe")))

    @property
    def drop_in(self) -> str:
        return (self.trailers.get("Drop-In") or "none").strip()

    @property
    def forwarded(self) -> bool:
        return (self.trailers.get("Forwarded") or "").strip().lower() == "yes"

    def hunks(self) -> dict[str, list[tuple[int, str]]]:
        """{path: [(old_start, header line)]} in patch order."""
        out: dict[str, list[tuple[int, str]]] = {}
        cur = None
        for line in self.text.splitlines():
            m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
            if m:
                cur = m.group(2)
                out.setdefault(cur, [])
                continue
            if cur and line.startswith("@@"):
                hm = re.match(r"^@@ -(\d+)", line)
                out[cur].append((int(hm.group(1)) if hm else 0, line.strip()))
        return out


def load_series(lay: Layout) -> list[Patch]:
    names = read_series(lay)
    if not names:
        raise HarnessError(f"{lay.rel(lay.series_file)}: no patches listed")
    out = []
    for n in names:
        p = lay.patches / n
        if not p.exists():
            raise HarnessError(f"series: {n} listed but missing")
        out.append(Patch.from_file(p, n))
    return out


# ---------------------------------------------------------------- release tree + apply


def lay_out_release(wheel: Path, dest: Path, rel_paths: list[str]) -> None:
    """Temp git repo with the wheel's files for ``rel_paths`` (``python/sglang/...``)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = set(zf.namelist())
        for rel in rel_paths:
            if not rel.startswith("python/"):
                continue
            member = rel[len("python/"):]
            if member in members:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
    git(dest, "init", "-q")
    git(dest, "add", "-A", "-f", ".")
    git(dest, "commit", "-q", "--allow-empty", "--no-verify", "-m", "release")


def parse_rejects(output: str, patch: Patch) -> tuple[list[str], list[str]]:
    """Rejected hunks from ``git apply --reject --verbose`` output: (problems, files)."""
    hunks = patch.hunks()
    problems: list[str] = []
    files: list[str] = []
    current = "?"
    for line in output.splitlines():
        m = re.match(r"^(?:Checking patch|Applying patch) (.+?)(?:\.\.\.| with \d+ rejects?\.\.\.)$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Rejected hunk #(\d+)\.$", line)
        if m:
            n = int(m.group(1))
            hl = hunks.get(current, [])
            head = hl[n - 1][1] if 0 < n <= len(hl) else ""
            problems.append(f"{current}: hunk #{n} {head}".rstrip())
            if current not in files:
                files.append(current)
    return problems, files


@dataclass
class ApplyResult:
    ok: bool
    offsets: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "path: hunk #n (@@ ...@@): why"
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "offsets": self.offsets, "problems": self.problems, "files": self.files}


def check_apply(repo: Path, patch: Patch, keep: bool = True) -> ApplyResult:
    """``git apply --check --verbose``; on failure list every rejected hunk (``--reject``
    in the scratch repo, then reset). With ``keep`` a clean patch is applied + committed."""
    chk = git(repo, "apply", "--check", "--verbose", str(patch.path), check=False)
    out = chk.stdout + chk.stderr
    res = ApplyResult(ok=chk.returncode == 0)
    current = "?"
    for line in out.splitlines():
        m = re.match(r"^Checking patch (.+)\.\.\.$", line)
        if m:
            current = m.group(1)
        m = re.match(r"^Hunk #(\d+) succeeded at (\d+) \((.*)\)\.?$", line)
        if m:
            res.offsets.append(f"{current}: hunk #{m.group(1)} at {m.group(2)} ({m.group(3)})")
    if res.ok:
        if keep:
            git(repo, "apply", str(patch.path))
            git(repo, "add", "-A", "-f", ".")
            git(repo, "commit", "-q", "--no-verify", "-m", patch.subject or patch.name)
        return res
    hunks = patch.hunks()
    for m in re.finditer(
        r"^error: (.+?): (does not exist in index|No such file or directory|already exists in "
        r"working directory|does not match index)$", out, re.M,
    ):
        res.problems.append(f"{m.group(1)}: {m.group(2)} (all {len(hunks.get(m.group(1), []))} hunks)")
        res.files.append(m.group(1))
    rej = git(repo, "apply", "--reject", "--verbose", str(patch.path), check=False)
    probs, files = parse_rejects(rej.stdout + rej.stderr, patch)
    res.problems += probs
    res.files += [f for f in files if f not in res.files]
    if not res.problems:
        errs = [x for x in out.splitlines() if x.startswith("error:")]
        res.problems.append(errs[0][6:].strip() if errs else "does not apply")
    git(repo, "reset", "-q", "--hard")
    git(repo, "clean", "-qfdx")
    return res


# ---------------------------------------------------------------- status


@dataclass
class Cell:
    status: str
    probe: list[dict[str, Any]] = field(default_factory=list)
    apply: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    tests: str = "not run"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "probe": self.probe, "apply": self.apply,
                "notes": self.notes, "tests": self.tests}


def release_status(wheel: Path, patches: list[Patch], scratch: Path) -> dict[str, Cell]:
    """Status of every patch on one release (series order; landed ones are skipped when
    applying the rest, as a rebase would drop them)."""
    tree = ZipTree(wheel)
    cells: dict[str, Cell] = {}
    repo = scratch / "release"
    touched = sorted({f for p in patches for f in p.files})
    lay_out_release(wheel, repo, touched)
    failed_before: list[str] = []
    try:
        for p in patches:
            results = run_probes(tree, p.probes)
            landed = combine(results)
            cell = Cell("applies", probe=[r.to_json() for r in results])
            if not p.probes:
                cell.notes.append("no Upstream-Probe declared: landed cannot be detected")
            elif landed is None:
                cell.notes.append("probe inconclusive: " + "; ".join(e for r in results for e in r.evidence))
            if landed is True:
                cell.status = "landed"
                cells[p.id] = cell
                continue
            res = check_apply(repo, p)
            cell.apply = res.to_json()
            if res.ok:
                cell.status = "applies"
                if res.offsets:
                    cell.notes.append(f"{len(res.offsets)} hunk(s) at an offset (no fuzz)")
            else:
                cell.status = "conflicts"
                if failed_before:
                    cell.notes.append("after earlier conflict(s) in " + ", ".join(failed_before))
                failed_before.append(p.id)
            cells[p.id] = cell
    finally:
        tree.close()
    return cells


def run_guard_tests(lay: Layout, python: str, patch_id: str, version: str) -> str:
    """Optional evidence: the patch's regression tests on an unpatched release."""
    try:
        got = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
            capture_output=True, text=True, timeout=120,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return f"not run ({python} unusable)"
    if got != version:
        return f"not run (--test-python has sglang {got or 'none'}, not {version})"
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--guards", patch_id,
         str(lay.root / "tests")],
        capture_output=True, text=True, cwd=lay.root,
    )
    if proc.returncode == 5:
        return "not run (no tests guard this patch)"
    return "pass (supports landed)" if proc.returncode == 0 else "fail (still needed)"


def upstream_status(
    lay: Layout,
    versions: list[str] | None = None,
    with_tests: bool = False,
    test_python: str | None = None,
) -> dict[str, Any]:
    pin = load_pin(lay)
    package = pin.get("package", "sglang")
    patches = load_series(lay)
    index = fetch_index(lay.cache, package)
    if versions:
        known = release_files(index, package)
        for v in versions:
            if v not in known:
                raise HarnessError(f"{package} {v}: not on {index.get('_url')}")
        versions = sorted(set(versions), key=version_key)
    else:
        versions = releases_after(index, pin["version"], package)
    if not versions:
        progress(f"no {package} release after {pin['version']} on {index.get('_url')}")
    report: dict[str, Any] = {
        "package": package,
        "pin": pin["version"],
        "index": index.get("_url"),
        "releases": [],
        "patches": [],
    }
    per_release: dict[str, dict[str, Cell]] = {}
    lay.build.mkdir(parents=True, exist_ok=True)
    for v in versions:
        entry = pick_wheel(index, v, package)
        wheel = release_wheel(lay.cache, index, entry)
        report["releases"].append(
            {"version": v, "wheel": entry["filename"], "sha256": entry["hashes"]["sha256"],
             "upload_time": entry.get("upload-time"), "path": str(wheel)}
        )
        with scratch(lay.build, "upstream") as tmp:
            per_release[v] = release_status(wheel, patches, Path(tmp))
        progress(f"  {v}: " + ", ".join(f"{p.id}={per_release[v][p.id].status}" for p in patches))
    for p in patches:
        first = next((v for v in versions if per_release[v][p.id].status == "landed"), None)
        if with_tests:
            for v in versions:
                per_release[v][p.id].tests = (
                    run_guard_tests(lay, test_python, p.id, v) if test_python
                    else "not run (pass --test-python PY with that release installed)"
                )
        drop = p.drop_in
        if drop.lower() == "none":
            agrees = first is None
        else:
            agrees = first == drop
        if drop.lower() != "none" and first is None and versions:
            # Drop-In names a release we did not scan (or that is not out yet)
            if drop not in versions:
                agrees = None
        report["patches"].append({
            "id": p.id,
            "file": p.name,
            "subject": p.subject,
            "forwarded": p.forwarded,
            "probes": p.probes,
            "drop_in": drop,
            "first_landed": first,
            "drop_in_agrees": agrees,
            "releases": {v: per_release[v][p.id].to_json() for v in versions},
        })
    return report


# ---------------------------------------------------------------- output


def render_table(report: dict[str, Any]) -> str:
    versions = [r["version"] for r in report["releases"]]
    ids = [p["id"] for p in report["patches"]]
    w0 = max([len("patch")] + [len(i) for i in ids])
    short = {"applies": "applies", "landed": "LANDED", "conflicts": "CONFLICT"}
    cols = [max(len(v), 8) for v in versions]
    lines = [f"upstream status of the series on {report['package']} releases after the pin "
             f"{report['pin']} ({report['index']})", ""]
    lines.append("  ".join([f"{'patch':<{w0}}"] + [f"{v:<{c}}" for v, c in zip(versions, cols)]
                           + ["first landed", "Drop-In", "agrees"]))
    for p in report["patches"]:
        cells = [short[p["releases"][v]["status"]] for v in versions]
        ag = {True: "yes", False: "NO", None: "n/a"}[p["drop_in_agrees"]]
        lines.append("  ".join([f"{p['id']:<{w0}}"] + [f"{c:<{w}}" for c, w in zip(cells, cols)]
                               + [f"{p['first_landed'] or '-':<12}", f"{p['drop_in']:<7}", ag]))
    lines.append("")
    for p in report["patches"]:
        lines.append(f"{p['id']} (probe: {', '.join(p['probes']) or 'none'}):")
        prev = None
        for v in versions:
            c = p["releases"][v]
            ev = [e for pr in c["probe"] for e in pr["evidence"]]
            msg = f"{c['status']}; evidence: {', '.join(_evidence(c)) or 'none'}; tests: {c['tests']}"
            detail = list(ev)
            if c["apply"] and c["apply"]["problems"]:
                detail = detail + ["conflict: " + x for x in c["apply"]["problems"]]
            detail += c["notes"]
            key = (msg, tuple(re.sub(r"\d+", "N", d) for d in detail))
            if key == prev:
                lines.append(f"  {v}: same as above")
                continue
            prev = key
            lines.append(f"  {v}: {msg}")
            for d in detail:
                lines.append(f"      {d}")
    return "\n".join(lines)


def _evidence(cell: dict[str, Any]) -> list[str]:
    ev = ["static probe"] if cell["probe"] else []
    if cell["apply"] is not None:
        ev.append("git apply --check")
    if not cell["tests"].startswith("not run"):
        ev.append("tests")
    return ev


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--versions", nargs="+", metavar="V",
                   help="releases to check (default: every release after the pin)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--with-tests", action="store_true",
                   help="optional: run each patch's guard tests on the unpatched release")
    p.add_argument("--test-python", metavar="PY",
                   help="interpreter with the release under test installed (for --with-tests)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a Drop-In trailer disagrees with the measured first landing")


def run(args: argparse.Namespace) -> int:
    lay = layout()
    versions = None
    if args.versions:
        versions = [v for item in args.versions for v in item.replace(",", " ").split()]
    report = upstream_status(lay, versions, with_tests=args.with_tests, test_python=args.test_python)
    print(render_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.strict and any(p["drop_in_agrees"] is False for p in report["patches"]):
        return 1
    return 0


def main() -> int:  # pragma: no cover
    from harness.cli import main as cli_main

    return cli_main(["upstream-status", *sys.argv[1:]])
