"""Which patches of a base's series go upstream as one PR.

A base's series keeps one concern per patch, which is what the fork needs to drop a
patch when upstream lands it. A maintainer reviews larger units: a change and its
follow-up in one PR (0.5.23 0003 + 0004: the last layer's capture in every model), an
infrastructure PR that others build on. ``harness/upstream/templates/<base>/bundles.toml``
says so::

    [[bundle]]
    id = "aux-packer-infra"              # the PR's id: build/pr/<id>/, its template
    title = "[Spec] ..."                 # the squashed commit's subject
    motivation = "..."                   # optional: the PR's own, instead of its
    modifications = "..."                # members' paragraphs joined
    patches = ["packer-capture-checked", "aux-packer-infra"]   # in series order

    [needs]                              # unit id (fnmatch pattern) -> units merged first
    "*-aux-packer" = ["aux-packer-infra"]

A bundle's patches need not be neighbours, but no patch between them may touch their
files (squashed, they move next to each other). A unit is a bundle or a patch in none. ``needs`` is for what file overlap cannot see: a
migration that imports a helper the infrastructure PR adds, in a file it does not touch.
Every other dependency is found from the lines a unit's patches read (``blame``), or,
where those do not apply, from the files (``prexport._walk``).
"""

from __future__ import annotations

import fnmatch
import re
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import HarnessError
from harness.upstream import prbody
from harness.upstream.prbody import strip_trailers

FILE = "bundles.toml"


@dataclass
class Unit:
    """One upstream PR: ``members``, patches of the series in its order (one, unless a
    bundle groups them), squashed into one commit."""

    id: str
    subject: str
    members: list[Any]
    needs: list[str] = field(default_factory=list)
    motivation: str = ""  # a bundle's own, in place of its members' joined
    modifications: str = ""

    @property
    def grouped(self) -> bool:
        return len(self.members) > 1 or self.members[0].id != self.id

    @property
    def forwarded(self) -> bool:
        return all(m.forwarded for m in self.members)

    @property
    def files(self) -> list[str]:
        return sorted({f for m in self.members for f in m.files})

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    @property
    def trailers(self) -> dict[str, str]:
        return self.members[-1].trailers

    def body(self, test_path: str | None = None) -> str:
        """The upstream commit body, trailers and fork paragraphs dropped. A bundle's
        joins its members' motivations, fixes and related threads; its testing
        paragraph names the bundle's one test (the members' own are replaced)."""
        if not self.grouped:
            return strip_trailers(self.members[0].body)
        bodies = [strip_trailers(m.body) for m in self.members]
        if self.motivation:
            paras = ["Motivation: " + _fill(self.motivation)]
        else:
            paras = ["Motivation: " + "\n\n".join(prbody.motivation(b) for b in bodies)]
        if self.modifications:
            paras.append("Fix: " + _fill(self.modifications) + "\n\nIt folds these commits:\n"
                         + "\n".join(f"- {m.subject}" for m in self.members))
        else:
            fixes = [prbody.section(b, "Fix") for b in bodies]
            paras.append("Fix: " + "\n\n".join(f for f in fixes if f))
        # Each member's threads once; those every PR body relates itself to in a table
        # (prbody.THREADS) stay there, where a member's "one family per PR" wording
        # would now be wrong.
        related: list[str] = []
        seen = {f"/pull/{n}" for n, _, _ in prbody.THREADS}
        for b in bodies:
            for item in re.split(r"\n(?=- )", prbody.section(b, "Related")):
                item = item.strip()
                url = re.search(r"/(?:pull|issues)/\d+", item)
                key = url.group(0).replace("/issues/", "/pull/") if url else item
                if item and key not in seen:
                    seen.add(key)
                    related.append(item)
        if related:
            paras.append("Related:\n" + "\n".join(related))
        if test_path:
            paras.append(textwrap.fill(
                f"Testing: {test_path} (CPU only, `register_cpu_ci`) covers the "
                f"{len(self.members)} changes of this PR.", 72, break_on_hyphens=False))
        return "\n\n".join(paras)


def _fill(text: str) -> str:
    """A bundles.toml text as commit paragraphs: blank lines kept, each paragraph
    wrapped at 72 columns; a table (lines starting with ``|``) kept line by line."""
    out = []
    for para in text.strip().split("\n\n"):
        lines = [line.strip() for line in para.strip().splitlines()]
        if lines and all(line.startswith("|") for line in lines):
            out.append("\n".join(lines))
        else:
            out.append(textwrap.fill(" ".join(para.split()), 72, break_on_hyphens=False))
    return "\n\n".join(out)


def max_depth(templates: Path) -> int | None:
    """The deepest chain of PRs the export accepts for this base (``max_depth`` at the top
    of ``bundles.toml``, a ratchet: lower it as the series is re-cut); None if unset."""
    path = templates / FILE
    if not path.exists():
        return None
    try:
        value = tomllib.loads(path.read_text()).get("max_depth")
    except tomllib.TOMLDecodeError as e:
        raise HarnessError(f"{path.name}: {e}") from None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise HarnessError(f"{path.name}: max_depth = {value!r}: a whole number of PRs, 1 or more")
    return value


def load(templates: Path, patches: list[Any]) -> list[Unit]:
    """The series' upstream units, in series order (a bundle where its first member
    is). A malformed ``bundles.toml`` is one error naming the file and the entry."""
    path = templates / FILE
    spec: dict[str, Any] = {}
    if path.exists():
        try:
            spec = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise HarnessError(f"{path.name}: {e}") from None
    index = {p.id: i for i, p in enumerate(patches)}
    owner: dict[str, dict[str, Any]] = {}
    for b in spec.get("bundle", []):
        bid, members = b.get("id"), b.get("patches") or []
        if not bid or not b.get("title") or len(members) < 1:
            raise HarnessError(f"{path.name}: a [[bundle]] needs id, title and patches: {b}")
        missing = [m for m in members if m not in index]
        if missing:
            raise HarnessError(f"{path.name}: bundle {bid}: no such patch in the series: {', '.join(missing)}")
        pos = [index[m] for m in members]
        if pos != sorted(set(pos)):
            raise HarnessError(f"{path.name}: bundle {bid}: its patches are not listed once each in series order")
        # Squashed into one commit, the members move next to each other: a patch between
        # them must not touch their files (it would then need to sit in the middle).
        own = {f for m in members for f in patches[index[m]].files}
        for q in patches[pos[0]:pos[-1]]:
            if q.id not in members and own & set(q.files):
                raise HarnessError(f"{path.name}: bundle {bid}: {q.id}, between its patches, touches "
                                   f"{sorted(own & set(q.files))[0]}, one of theirs")
        for m in members:
            if m in owner:
                raise HarnessError(f"{path.name}: {m} is in bundles {owner[m]['id']} and {bid}")
            owner[m] = b
    units: list[Unit] = []
    for p in patches:
        b = owner.get(p.id)
        if b is None:
            units.append(Unit(p.id, p.subject, [p]))
        elif b["patches"][0] == p.id:
            mem = [patches[index[m]] for m in b["patches"]]
            if len({m.forwarded for m in mem}) > 1:
                raise HarnessError(f"{path.name}: bundle {b['id']} mixes forwarded and fork-only patches")
            units.append(Unit(b["id"], b["title"], mem, motivation=b.get("motivation", ""),
                              modifications=b.get("modifications", "")))
    ids = [u.id for u in units]
    if len(set(ids)) != len(ids):
        raise HarnessError(f"{path.name}: a bundle id repeats another unit's id")
    for pattern, need in (spec.get("needs") or {}).items():
        need = [need] if isinstance(need, str) else list(need)
        hits = [u for u in units if fnmatch.fnmatchcase(u.id, pattern)]
        if not hits:
            raise HarnessError(f"{path.name}: needs: {pattern!r} names no unit of the series")
        for n in need:
            if n not in ids:
                raise HarnessError(f"{path.name}: needs: {pattern!r} -> {n}: no such unit")
        for u in hits:
            late = [n for n in need if ids.index(n) >= ids.index(u.id)]
            if late:
                raise HarnessError(f"{path.name}: needs: {u.id} needs {', '.join(late)}, which comes after it")
            u.needs += [n for n in need if n not in u.needs]
    return units


def needed_patches(units: list[Unit], unit: Unit) -> list[Any]:
    """The patches of every unit ``unit`` needs, transitively, in series order."""
    by_id = {u.id: u for u in units}
    seen: set[str] = set()
    todo = list(unit.needs)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += by_id[n].needs
    return [m for u in units if u.id in seen for m in u.members]


def unit_of(units: list[Unit], patch_id: str) -> Unit:
    return next(u for u in units if patch_id in u.ids)


def stack(needs: dict[str, list[str]]) -> dict:
    """The stacking graph of the bundles (``needs``: bundle -> the bundles it stacks on,
    each a PR to merge first): per bundle its depth (the PRs in its longest chain, itself
    included: 1 for a PR on the release) and that chain, the deepest chain overall."""
    memo: dict[str, list[str]] = {}

    def chain(b: str, seen: tuple[str, ...] = ()) -> list[str]:
        if b in seen:
            raise HarnessError(f"bundles stack in a circle: {' -> '.join((*seen, b))}")
        if b not in memo:
            longest = max((chain(d, (*seen, b)) for d in needs.get(b, [])), key=len, default=[])
            memo[b] = [*longest, b]
        return memo[b]

    chains = {b: chain(b) for b in needs}
    deepest = max(chains.values(), key=len, default=[])
    return {"needs": {b: sorted(needs[b]) for b in needs},
            "depth": {b: len(c) for b, c in chains.items()},
            "chain": chains, "max_depth": len(deepest), "deepest": deepest}
