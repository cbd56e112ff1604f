"""Which earlier patches of a series a patch reads: those that wrote a line its hunks
change or keep as context.

A PR is stacked on the PRs whose lines it needs to apply. File overlap
(``prexport._walk``) over-approximates that: a patch that edits one model file would
stack on every earlier patch that ever touched the file, and on every patch those
touch, so one late PR ends up behind most of the series. Here each hunk's pre-image
(``@@ -start,count``) is blamed at the series commit before the patch: the earlier
patches that wrote those lines are the ones it reads. Blame cannot see a line an
earlier patch deleted from the range, so what this finds is checked by applying it;
``prexport`` falls back to the file walk, and says so, when it does not apply.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from harness import HarnessError
from harness.patchset.git import git

HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")


class Unreadable(Exception):
    """What a patch reads cannot be told from its diff (a quoted path, a failed blame)."""


def preimage_ranges(patch_text: str) -> dict[str, list[tuple[int, int]]]:
    """Per file the patch changes (not one it creates), each hunk's pre-image as (first
    line, line count); a hunk that only adds to an empty range has none. A path git
    quotes (non-ASCII, control characters) is :class:`Unreadable`."""
    out: dict[str, list[tuple[int, int]]] = {}
    path, header = None, False
    for line in patch_text.split("\n"):
        if line.startswith("diff --git "):
            path, header = None, True
        elif header and line.startswith('--- "'):
            raise Unreadable(f"a quoted path: {line[4:]}")
        elif header and line.startswith("--- "):
            # git ends the name with a TAB when it holds a space
            path = line[len("--- a/"):].rstrip("\t") if line.startswith("--- a/") else None
        elif line.startswith("@@ "):
            header = False
            m = HUNK.match(line)
            if path and m and (count := int(m.group(2) or 1)):
                out.setdefault(path, []).append((int(m.group(1)), count))
    return out


class SeriesLines:
    """The series as one commit per patch on the release (``repo``, from ``base``):
    ``commits[i]`` holds ``patches[i]``."""

    def __init__(self, repo: Path, base: str, patches: Sequence[Any]) -> None:
        self.repo, self.patches = repo, list(patches)
        self.commits = git(repo, "rev-list", "--reverse", f"{base}..HEAD").stdout.split()
        if len(self.commits) != len(self.patches):
            raise HarnessError(f"{repo}: {len(self.commits)} commits after {base}, "
                               f"the series has {len(self.patches)} patches")
        self.position = {c: i for i, c in enumerate(self.commits)}
        self._index = {p.id: i for i, p in enumerate(self.patches)}
        self._reads: dict[int, frozenset[int]] = {}

    @classmethod
    def build(cls, repo: Path, tag: str, patches: Sequence[Any]) -> "SeriesLines":
        """``git am`` of every patch in ``repo``, a checkout of ``tag``; one line naming
        the patch that does not apply."""
        for p in patches:
            if git(repo, "am", "--keep-cr", "--no-3way", str(p.path), check=False).returncode != 0:
                git(repo, "am", "--abort", check=False)
                raise HarnessError(f"{p.name}: does not apply in series order on {tag}")
        return cls(repo, tag, patches)

    def read_by(self, patch: Any) -> list[Any]:
        """The earlier patches ``patch`` reads (:meth:`reads`), as patches."""
        return [self.patches[j] for j in self.reads(self._index[patch.id])]

    def reads(self, i: int) -> frozenset[int]:
        """The positions of the earlier patches that wrote a line of patch ``i``'s
        hunks' pre-images (the hunks of its commit here, as applied); one that cannot be
        told is :class:`Unreadable`."""
        if i not in self._reads:
            commit = self.commits[i]
            diff = git(self.repo, "diff", "--no-color", "--no-ext-diff", "-U3", f"{commit}^", commit).stdout
            found: set[int] = set()
            for path, ranges in preimage_ranges(diff).items():
                spans = [a for start, count in ranges for a in ("-L", f"{start},+{count}")]
                res = git(self.repo, "blame", "--porcelain", *spans, f"{commit}^", "--", path, check=False)
                if res.returncode != 0:
                    raise Unreadable(f"git blame {path}: {(res.stderr.strip().splitlines() or ['failed'])[0]}")
                for line in res.stdout.split("\n"):
                    if not line.startswith("\t"):  # a header line; content starts with a TAB
                        j = self.position.get(line.split(" ", 1)[0])
                        if j is not None:
                            found.add(j)
            self._reads[i] = frozenset(found)
        return self._reads[i]
