"""Where things are: the repository layout every patch-tooling verb works on.

Paths are injectable: every function takes a :class:`Layout`, built by :func:`layout`
from an explicit root, ``$HARNESS_ROOT``, or the repository this package lives in.

Bases: the default base is the pin, ``patches/pin.json`` + ``patches/series``, built in
``build/sglang``. Another base (e.g. the newest release, for upstreaming) lives in
``patches/<version>/`` (its own pin.json, series and patches) and builds in
``build/sglang-<version>``, with ``build/{dist,results,ablation}-<version>``. The base is
``layout(base=...)``, else ``$HARNESS_BASE`` (``make ... BASE=0.5.23``); naming the pin's
own version is the default base.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT, HarnessError

STATE_FILE = "auxcap-state.json"  # inside build/sglang/.git/


@dataclass(frozen=True)
class Layout:
    root: Path
    base: str | None = None  # None: the default base (the pin)

    def _suffixed(self, name: str) -> str:
        return name if self.base is None else f"{name}-{self.base}"

    @property
    def patches(self) -> Path:
        return self.root / "patches" if self.base is None else self.root / "patches" / self.base

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
        return self.build / self._suffixed("sglang")

    @property
    def dist(self) -> Path:
        return self.build / self._suffixed("dist")

    @property
    def results(self) -> Path:
        return self.build / self._suffixed("results")

    @property
    def doctor(self) -> Path:
        """Where ``doctor`` writes its report and ``doctor-demo`` its checkpoints."""
        return self.build / self._suffixed("doctor")

    @property
    def ablation(self) -> Path:
        """Where the ablation lays out its trees (one per patch left out)."""
        return self.build / self._suffixed("ablation")

    @property
    def pr_trees(self) -> Path:
        """pr-export's test trees: checkouts of the release kept between bundles and runs,
        so only the files a bundle changes are rewritten (and recompiled)."""
        return self.build / self._suffixed("pr-trees")

    @property
    def label(self) -> str:
        """The base's name for messages: its pin version."""
        try:
            return json.loads(self.pin_file.read_text())["version"]
        except (OSError, ValueError, KeyError):
            return self.base or "pin"

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


def bases(root: Path) -> list[str]:
    """The other bases: ``patches/<version>/`` folders that hold a pin.json."""
    top = root / "patches"
    return sorted(p.parent.name for p in top.glob("*/pin.json")) if top.is_dir() else []


def layout(root: str | Path | None = None, base: str | None = None) -> Layout:
    if root is None:
        root = os.environ.get("HARNESS_ROOT") or ROOT
    root = Path(root).resolve()
    base = base if base is not None else (os.environ.get("HARNESS_BASE") or None)
    if base:
        default = Layout(root)
        try:
            pin_version = json.loads(default.pin_file.read_text()).get("version")
        except (OSError, ValueError):
            pin_version = None
        if base == pin_version:
            base = None
        elif not (root / "patches" / base / "pin.json").is_file():
            known = ", ".join([pin_version or "the pin"] + bases(root))
            raise HarnessError(f"unknown base {base}: no patches/{base}/pin.json (bases: {known})")
    return Layout(root, base)
