"""``check-patches``: series + metadata lint, zero-fuzz apply, round trip, style.

Every problem is reported on its own line; the exit status is 1 if there was any.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from harness import ROOT, HarnessError, progress
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin
from harness.patchset.scratch import scratch as scratch_dir
from harness.patchset.series import parse_series, patch_files, patch_message

# How SGLang's own formatters and linters are run (its .pre-commit-config is not in the
# wheel): name -> (package pinned in requirements/style*.in, argv that prints one line or
# one diff hunk per finding). A base's style file pins the tools of that release: black +
# isort for the pin, ruff's formatter for 0.5.23 (which keeps 0.5.23's files unchanged
# where black does not). Findings are counted on each touched file before and after the
# series: a patch may not add any (0.5.23's own files are not all clean).
STYLE_ARGS = {
    "black": ("black", ["black", "--diff", "--quiet"]),
    "isort": ("isort", ["isort", "--profile", "black", "-p", "sglang", "--diff", "--quiet"]),
    "ruff-format": ("ruff", ["ruff", "format", "--no-cache", "--diff", "--quiet"]),
    "codespell": ("codespell", ["codespell_lib", "--ignore-words-list", "mis,ans"]),
    # SGLang's pre-commit runs ruff for unused imports / undefined names.
    "ruff": ("ruff", ["ruff", "check", "--no-cache", "--output-format", "concise", "--select", "F401,F821"]),
}
REQUIRED_TRAILERS = ("Patch-Id", "Origin", "Forwarded", "Upstream-Status", "Drop-In")
PATCH_ID_RE = re.compile(r"^[a-z0-9-]+$")
DROP_IN_RE = re.compile(r"^(none|\d+(\.\d+)*(\.?post\d+|rc\d+)?)$")


def style_file(lay: Layout) -> Path:
    """requirements/style.in for the pin, requirements/style-<base>.in for another base."""
    name = "style.in" if lay.base is None else f"style-{lay.base}.in"
    path = lay.root / "requirements" / name
    return path if path.exists() else ROOT / "requirements" / name


def style_tools(lay: Layout) -> list[tuple[str, str]]:
    """[(package, version)] pinned in the base's style file (the one place they are set)."""
    path = style_file(lay)
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, ver = line.split("==", 1)
                out.append((name.strip(), ver.strip()))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-apply", action="store_true", help="lint only: skip the apply/round-trip/style steps")
    p.add_argument("--no-style", action="store_true", help="skip black/isort/codespell")


def run(args: argparse.Namespace) -> int:
    problems = check_patches(layout(), apply=not args.no_apply, style=not args.no_style)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if problems:
        print(f"check-patches: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check-patches: ok")
    return 0


def lint_series(lay: Layout) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    if not lay.series_file.exists():
        return [f"{lay.rel(lay.series_file)}: missing"], []
    _, names = parse_series(lay.series_file.read_text())
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append(f"series: {n} listed more than once")
        seen.add(n)
        if not (lay.patches / n).exists():
            problems.append(f"series: {n} listed but missing")
    for f in sorted(lay.patches.glob("*.patch")):
        if f.name not in seen:
            problems.append(f"series: {f.name} exists but is not listed")
    return problems, [n for i, n in enumerate(names) if n not in names[:i]]


def _header(mail: str, name: str) -> str:
    """A header of a ``git format-patch`` mail, its continuation lines joined."""
    lines = mail.partition("\n\n")[0].splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{name}:"):
            value = line[len(name) + 1:].strip()
            for cont in lines[i + 1:]:
                if not cont.startswith((" ", "\t")):
                    break
                value += " " + cont.strip()
            return value
    return ""


def lint_metadata(lay: Layout, names: list[str]) -> list[str]:
    problems = []
    ids: dict[str, str] = {}
    first_author: tuple[str, str] | None = None
    for n in names:
        path = lay.patches / n
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        subject, _, tr = patch_message(text)
        if not subject:
            problems.append(f"{n}: no Subject")
        # One author for the series, its first patch's: the one name a maintainer sees on
        # the exported patches and the upstream bundles (a patch committed under another
        # git identity carries that one instead).
        author = _header(text, "From")
        first_author = first_author or (n, author)
        if author != first_author[1]:
            problems.append(f"{n}: author {author!r}, not the series' {first_author[1]!r} "
                            f"(of {first_author[0]}; commit --amend --author, then make export-patches)")
        for key in REQUIRED_TRAILERS:
            if not tr.get(key):
                problems.append(f"{n}: missing trailer {key}:")
        pid = tr.get("Patch-Id")
        if pid:
            if not PATCH_ID_RE.match(pid):
                problems.append(f"{n}: Patch-Id {pid!r} must match [a-z0-9-]+")
            if pid in ids:
                problems.append(f"{n}: Patch-Id {pid} also used by {ids[pid]}")
            ids[pid] = n
        fwd = tr.get("Forwarded")
        if fwd and fwd not in ("yes", "no"):
            problems.append(f"{n}: Forwarded must be yes or no, not {fwd!r}")
        origin = tr.get("Origin")
        if origin and not re.match(r"^(upstream, https?://\S+|new(, port of https?://\S+)?)$", origin):
            problems.append(f"{n}: Origin must be 'upstream, URL', 'new' or 'new, port of URL', not {origin!r}")
        drop = tr.get("Drop-In")
        if drop and not DROP_IN_RE.match(drop):
            problems.append(f"{n}: Drop-In must be a version or 'none', not {drop!r}")
    return problems


def check_apply_and_roundtrip(lay: Layout, names: list[str], scratch: Path) -> tuple[list[str], Path | None]:
    """Apply into a scratch tree (zero fuzz), export into a scratch dir, byte-compare."""
    from harness.patchset.apply import build_tree
    from harness.patchset.export import format_patches

    pin = load_pin(lay)
    tree = scratch / "sglang"
    try:
        build_tree(lay, tree, pin, "wheel", [lay.patches / n for n in names], verbose=False)
    except HarnessError as exc:
        return [f"apply: {exc}"], None
    problems = []
    from harness.patchset.pin import base_tag

    out = format_patches(tree, base_tag(pin), scratch / "export")
    exported = [p.name for p in out]
    if exported != names:
        problems.append(f"round trip: export names {exported} differ from series {names}")
    for p in out:
        orig = lay.patches / p.name
        if orig.exists() and not filecmp.cmp(p, orig, shallow=False):
            problems.append(f"round trip: {p.name} differs after apply+export; run `make export-patches`")
    return problems, tree


def check_prefixes(lay: Layout, tree: Path, names: list[str]) -> list[str]:
    """Every prefix of the series must compile: each touched .py file, at each commit."""
    from harness.patchset.git import git
    from harness.patchset.pin import base_tag

    pin = load_pin(lay)
    commits = git(tree, "rev-list", "--reverse", f"{base_tag(pin)}..HEAD").stdout.split()
    problems = []
    touched: list[str] = []
    for name, commit in zip(names, commits):
        for f in patch_files((lay.patches / name).read_text(errors="replace")):
            if f.endswith(".py") and f not in touched:
                touched.append(f)
        for f in touched:
            proc = subprocess.run(["git", "-C", str(tree), "show", f"{commit}:{f}"],
                                  capture_output=True)
            if proc.returncode != 0:
                continue  # deleted at this prefix
            try:
                compile(proc.stdout, f, "exec")
            except SyntaxError as exc:
                problems.append(f"prefix: after {name}: {f}:{exc.lineno}: does not compile: {exc.msg}")
    return problems


def style_checks(lay: Layout) -> list[tuple[str, str, str]]:
    """[(check, package, pinned version)] for the base: its pinned packages' checks; ruff's
    formatter only where black is not pinned."""
    pinned = dict(style_tools(lay))
    out = []
    for check, (package, _argv) in STYLE_ARGS.items():
        if package not in pinned or (check == "ruff-format" and "black" in pinned):
            continue
        out.append((check, package, pinned[package]))
    return out


def _findings(argv: list[str], path: Path, cwd: Path) -> list[str]:
    proc = subprocess.run(argv + [str(path)], cwd=cwd, capture_output=True, text=True)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip() and not x.startswith("Oh no")]
    hunks = [x for x in lines if x.startswith("@@")]
    if hunks or any(x.startswith(("---", "+++")) for x in lines):
        return hunks or lines[:1]
    if proc.returncode != 0:
        return [x for x in lines if not x.startswith(("Found ", "[*]", "All checks", "would reformat", "1 file"))] \
            or [f"exit {proc.returncode}"]
    return []


def check_style(lay: Layout, tree: Path, names: list[str]) -> list[str]:
    from harness.patchset.git import git
    from harness.patchset.pin import base_tag

    problems = []
    files: list[str] = []
    for n in names:
        for f in patch_files((lay.patches / n).read_text(errors="replace")):
            if f.endswith(".py") and (tree / f).exists() and f not in files:
                files.append(f)
    if not files:
        return []
    tag = base_tag(load_pin(lay))
    with scratch_dir(lay.build, "style") as tmp:
        before_dir = Path(tmp)
        for f in files:
            old = git(tree, "show", f"{tag}:{f}", check=False)
            if old.returncode == 0:
                dest = before_dir / f
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(old.stdout)
        for check, package, version in style_checks(lay):
            mod = "codespell_lib" if package == "codespell" else package
            if importlib.util.find_spec(mod) is None:
                progress(f"  style: {package} not installed, skipped (pinned {version})")
                continue
            try:
                from importlib.metadata import version as dist_version

                have = dist_version(package)
            except Exception:  # noqa: BLE001
                have = "?"
            if have != version:
                progress(f"  style: {package} {have} installed, {version} pinned")
            argv = [sys.executable, "-m", *STYLE_ARGS[check][1]]
            for f in files:
                after = _findings(argv, Path(f), tree)
                if not after:
                    continue
                before = _findings(argv, Path(f), before_dir) if (before_dir / f).exists() else []
                if len(after) > len(before):
                    new = [x for x in after if x not in before] or after
                    problems.append(f"style: {check}: {f}: {len(after) - len(before)} new finding(s) "
                                    f"({len(before)} at {tag}): {new[0]}")
    return problems


# The PR unit tests pr-export adds to each upstream bundle (harness/upstream/templates/,
# one folder per other base): new files upstream, so held to the base's style with no
# baseline.
TEMPLATES = ROOT / "harness" / "upstream" / "templates"


def check_template_style(lay: Layout, tree: Path) -> list[str]:
    """The base's style checks on each PR test template, as it goes upstream (its
    ``# upstream-path:`` line dropped), laid out in ``tree`` so the checks read that
    tree's configuration."""
    folder = TEMPLATES if lay.base is None else TEMPLATES / lay.base
    templates = sorted(folder.glob("*.py"))
    if not templates:
        return []
    problems = []
    with scratch_dir(tree, "templates") as tmp:
        copies = []
        for t in templates:
            text = re.sub(r"^# upstream-path:.*\n", "", t.read_text(), count=1, flags=re.M)
            (Path(tmp) / t.name).write_text(text)
            copies.append((t, Path(tmp) / t.name))
        for check, package, _version in style_checks(lay):
            mod = "codespell_lib" if package == "codespell" else package
            if importlib.util.find_spec(mod) is None:
                continue
            argv = [sys.executable, "-m", *STYLE_ARGS[check][1]]
            for template, copy in copies:
                found = _findings(argv, copy, tree)
                if found:
                    shown = template.relative_to(ROOT) if template.is_relative_to(ROOT) else template
                    problems.append(f"style: {check}: {shown}: {len(found)} "
                                    f"finding(s) (a PR test template): {found[0]}")
    return problems


def check_patches(lay: Layout, apply: bool = True, style: bool = True) -> list[str]:
    problems, names = lint_series(lay)
    problems += lint_metadata(lay, names)
    if apply and all((lay.patches / n).exists() for n in names):
        with scratch_dir(lay.build, "check") as tmp:
            more, tree = check_apply_and_roundtrip(lay, names, tmp)
            problems += more
            if tree is not None:
                problems += check_prefixes(lay, tree, names)
            if style and tree is not None:
                problems += check_style(lay, tree, names)
                problems += check_template_style(lay, tree)
    return problems
