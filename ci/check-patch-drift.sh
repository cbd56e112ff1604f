#!/usr/bin/env bash
# Re-apply the series to a fresh build/sglang, re-export it, and fail if patches/
# changes: the committed patch files must be exactly what `export-patches` writes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Every base: the pin (patches/) and each patches/<version>/ with a pin.json.
for base in "" $(find patches -mindepth 2 -maxdepth 2 -name pin.json | cut -d/ -f2 | sort -V); do
    HARNESS_BASE=$base "$PY" -m harness apply-patches --force
    HARNESS_BASE=$base "$PY" -m harness export-patches
done
untracked=$(git ls-files --others --exclude-standard -- patches/)
if ! git diff --quiet --exit-code -- patches/ || [ -n "$untracked" ]; then
    git --no-pager diff --stat -- patches/
    [ -z "$untracked" ] || printf 'untracked: %s\n' "$untracked"
    echo "error: patches/ drifted from its re-export: run \`make apply-patches && make export-patches\` (with BASE= for patches/<version>/) and commit the result" >&2
    exit 1
fi
echo "patches/: no drift ($(cat patches/series patches/*/series | grep -cv '^\s*\(#\|$\)') patches over every base)"
