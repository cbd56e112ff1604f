"""``build-wheel``: the patched, installable sglang wheel in build/dist.

There is no sdist: take the pinned cp311 wheel from the cache, swap in the ``sglang/``
files of build/sglang/python/sglang (the compiled ``*.so`` are kept from the wheel), set
the version ``<pin>+auxcap.<series id>`` (METADATA, dist-info name, sglang/_version.py),
regenerate RECORD and write a deterministic zip (fixed timestamps, sorted entries).

Why not pypa ``wheel unpack`` / ``wheel pack`` (with SOURCE_DATE_EPOCH): they would do the
RECORD and timestamps, but not the version rename (dist-info directory, METADATA,
``_version.py``), so this module would keep most of its work; and this verb runs with the
stdlib alone (the bare bootstrap interpreter, the GPU image's own Python), where ``wheel``
is one more pinned package to provision for ~40 lines of zip and csv. The output is
checked for determinism by tests/patchset/test_export_check_build.py.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import zipfile
from pathlib import Path

from harness import HarnessError, progress
from harness.patchset.layout import Layout, layout
from harness.patchset.pin import load_pin, patched_version, pin_wheel
from harness.patchset.series import series_id

ZIP_DATE = (2026, 6, 15, 0, 0, 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-apply", action="store_true", help="do not run apply-patches first")


def run(args: argparse.Namespace) -> int:
    build_wheel(layout(), apply=not args.no_apply)
    return 0


def wheel_path(lay: Layout) -> tuple[Path, str]:
    pin = load_pin(lay)
    version = patched_version(pin, series_id(lay))
    name, _ = pin_wheel(pin)
    tag = name[len(f"{pin['package']}-{pin['version']}-") :]
    return lay.dist / f"{pin['package']}-{version}-{tag}", version


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def set_version_py(text: str, version: str) -> str:
    base, _, local = version.partition("+")
    parts = [int(x) if x.isdigit() else x for x in re.split(r"\.(?=\d|post|dev|rc)|(?<=\d)(?=post)", base)]
    parts = [p for p in parts if p != ""]
    if local:
        parts.append(local)
    text = re.sub(r"(__version__ = version = )'[^']*'", lambda m: f"{m.group(1)}{version!r}", text)
    text = re.sub(r"(__version_tuple__ = version_tuple = )\([^)]*\)", lambda m: f"{m.group(1)}{tuple(parts)!r}", text)
    return text


# Bump when the wheel layout/RECORD logic changes, so an old build is not reused.
BUILDER_VERSION = "2"


def build_wheel(lay: Layout, apply: bool = True) -> Path:
    from harness.patchset.apply import apply_patches, fetch_wheel

    if apply:
        apply_patches(lay)
    out, version = wheel_path(lay)
    stamp = out.with_name(out.name + ".builder")
    if out.exists() and stamp.exists() and stamp.read_text() == BUILDER_VERSION:
        progress(f"wheel up to date: {lay.rel(out)}")
        return out
    pin = load_pin(lay)
    pkg, old_ver = pin["package"], pin["version"]
    src_wheel = fetch_wheel(lay, pin)
    tree_pkg = lay.tree / "python" / pkg
    if not tree_pkg.is_dir():
        raise HarnessError(f"{lay.rel(tree_pkg)}: missing; run `make apply-patches`")
    old_info, new_info = f"{pkg}-{old_ver}.dist-info/", f"{pkg}-{version}.dist-info/"
    files: dict[str, tuple[bytes, int]] = {}
    changed = added = removed = 0
    with zipfile.ZipFile(src_wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/") or name == old_info + "RECORD":
                continue
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            data = zf.read(info)
            if name.startswith(pkg + "/") and not name.endswith(".so"):
                local = lay.tree / "python" / name
                if not local.exists():
                    removed += 1
                    continue
                new = local.read_bytes()
                changed += new != data
                data = new
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name == new_info + "METADATA":
                    data = re.sub(rb"(?m)^Version: .*$", f"Version: {version}".encode(), data, count=1)
            files[name] = (data, mode)
    for path in sorted(tree_pkg.rglob("*")):
        rel = path.relative_to(lay.tree / "python").as_posix()
        if path.is_file() and "__pycache__" not in rel and rel not in files:
            files[rel] = (path.read_bytes(), 0o755 if path.stat().st_mode & 0o111 else 0o644)
            added += 1
    vpy = f"{pkg}/_version.py"
    if vpy in files:
        files[vpy] = (set_version_py(files[vpy][0].decode(), version).encode(), files[vpy][1])
    order = sorted(n for n in files if not n.startswith(new_info)) + sorted(n for n in files if n.startswith(new_info))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for n in order:
        writer.writerow([n, _record_hash(files[n][0]), len(files[n][0])])
    writer.writerow([new_info + "RECORD", "", ""])
    record = buf.getvalue()
    files[new_info + "RECORD"] = (record.encode(), 0o644)
    order.append(new_info + "RECORD")
    lay.dist.mkdir(parents=True, exist_ok=True)
    for stale in [*lay.dist.glob(f"{pkg}-*.whl"), *lay.dist.glob(f"{pkg}-*.whl.builder")]:
        stale.unlink()
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for n in order:
            info = zipfile.ZipInfo(n, ZIP_DATE)
            info.external_attr = (0o100000 | files[n][1]) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, files[n][0])
    tmp.replace(out)
    stamp.write_text(BUILDER_VERSION)
    progress(f"built {lay.rel(out)} ({changed} changed, {added} added, {removed} removed files)")
    return out
