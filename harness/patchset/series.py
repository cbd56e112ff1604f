"""The series: ``patches/series`` (order) and the patch files it lists (mail format).

Parsing only: subject, body and trailers of a ``git format-patch`` mail, the paths a
patch touches, and the series id that names a build. Stdlib only.
"""

from __future__ import annotations

import hashlib
import re

from harness.patchset.layout import Layout, layout


def parse_series(text: str) -> tuple[list[str], list[str]]:
    """(header lines, patch names). Header = leading comment/blank lines."""
    header: list[str] = []
    names: list[str] = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.append(entry)
        elif not names:
            header.append(line)
    return header, names


def read_series(lay: Layout) -> list[str]:
    if not lay.series_file.exists():
        return []
    return parse_series(lay.series_file.read_text())[1]


def series_id(lay: Layout | None = None) -> str:
    """sha256 over pin.json + series + each listed patch's bytes; first 10 hex digits."""
    lay = lay or layout()
    h = hashlib.sha256()
    h.update(lay.pin_file.read_bytes())
    h.update(lay.series_file.read_bytes() if lay.series_file.exists() else b"")
    for name in read_series(lay):
        path = lay.patches / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.exists() else b"<missing>")
    return h.hexdigest()[:10]


_TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s*(.*)$")


def patch_message(text: str) -> tuple[str, str, dict[str, str]]:
    """(subject, body, trailers) of a ``git format-patch`` mail."""
    head, _, rest = text.partition("\n\n")
    subject = ""
    lines = head.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject:"):
            subject = line[len("Subject:") :].strip()
            for cont in lines[i + 1 :]:
                if cont.startswith((" ", "\t")):
                    subject += " " + cont.strip()
                else:
                    break
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    body = re.split(r"^(?:---$|diff --git )", rest, maxsplit=1, flags=re.M)[0]
    paragraphs = [p for p in body.strip().split("\n\n") if p.strip()]
    trailers: dict[str, str] = {}
    if paragraphs:
        last = paragraphs[-1].splitlines()
        parsed = [_TRAILER_RE.match(x) for x in last]
        if all(parsed):
            for m in parsed:
                assert m is not None
                trailers.setdefault(m.group(1), m.group(2).strip())
    return subject, body, trailers


def patch_files(text: str) -> list[str]:
    """Paths (post-image, or pre-image for deletions) a patch touches."""
    out: list[str] = []
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", text, re.M):
        if m.group(2) not in out:
            out.append(m.group(2))
    return out


def hunk_for_line(text: str, path: str, line: int) -> str:
    """Describe the hunk of ``path`` in a patch whose old start is ``line``."""
    current = None
    n = 0
    best = None
    for raw in text.splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", raw)
        if m:
            current = m.group(1)
            n = 0
            continue
        if current == path and raw.startswith("@@"):
            n += 1
            hm = re.match(r"^@@ -(\d+)", raw)
            if hm and int(hm.group(1)) == line:
                return f"hunk #{n} ({raw.strip()})"
            if best is None:
                best = f"hunk #{n} ({raw.strip()})"
    return f"hunk at line {line}" if best is None else f"hunk at line {line}"
