#!/usr/bin/env bash
# Re-apply the series to a fresh build/sglang, re-export it, and fail if patches/
# changes: the committed patch files must be exactly what `export-patches` writes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m harness apply-patches --force
"$PY" -m harness export-patches
untracked=$(git ls-files --others --exclude-standard -- patches/)
if ! git diff --quiet --exit-code -- patches/ || [ -n "$untracked" ]; then
    git --no-pager diff --stat -- patches/
    [ -z "$untracked" ] || printf 'untracked: %s\n' "$untracked"
    echo "error: patches/ drifted from its re-export: run \`make apply-patches && make export-patches\` and commit the result" >&2
    exit 1
fi
echo "patches/: no drift ($(grep -cv '^\s*\(#\|$\)' patches/series) patches)"
