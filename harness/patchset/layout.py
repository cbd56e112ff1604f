"""Where things are: the repository layout every patch-tooling verb works on.

Paths are injectable: every function takes a :class:`Layout`, built by :func:`layout`
from an explicit root, ``$HARNESS_ROOT``, or the repository this package lives in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT

STATE_FILE = "auxcap-state.json"  # inside build/sglang/.git/


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def pin_file(self) -> Path:
        return self.patches / "pin.json"

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def tree(self) -> Path:
        return self.build / "sglang"

    @property
    def dist(self) -> Path:
        return self.build / "dist"

    @property
    def cache(self) -> Path:
        return Path(os.environ.get("HARNESS_CACHE", self.root / ".cache" / "pypi"))

    @property
    def state_file(self) -> Path:
        return self.tree / ".git" / STATE_FILE

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


def layout(root: str | Path | None = None) -> Layout:
    if root is None:
        root = os.environ.get("HARNESS_ROOT") or ROOT
    return Layout(Path(root).resolve())
