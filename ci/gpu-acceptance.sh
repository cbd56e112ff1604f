#!/usr/bin/env bash
# The upstream bundles' GPU checks on one GPU: each named model served by SGLang's own
# server on the pristine release and with the series, side by side (acceptance length
# and memory_usage for a draft, the returned rows for the return-aux path). Checks and
# the bundles they prove: harness/suites/acceptance.py; a bundle's body prints the
# command lines it runs.
#
# usage: ci/gpu-acceptance.sh [CHECK...]   (default: all)
# env:   BASE (default 0.5.23, the bundles' base), SHAREGPT (a local ShareGPT json for
#        the draft checks: the GPU machines are offline), the models in the HF cache.
# Without a GPU it prepares what it can and stops with one line saying so (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
exec make test-gpu BASE="${BASE:-0.5.23}" ARGS="--acceptance ${*:-all}"
