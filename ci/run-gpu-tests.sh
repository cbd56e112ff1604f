#!/usr/bin/env bash
# Run the GPU suites in the GPU image at TP=1,2,4 (NCCL), one container per TP, and
# collect JUnit/memory results in build/results/gpu/tp<N>/.
#
# env: GPU_IMAGE (default: build/gpu-image.txt, else auxcap/gpu:<series id>),
#      TPS (default "1 2 4"), RESULTS_DIR (default build/results/gpu),
#      GPU_TEST_ARGS (extra args for `test-gpu`).
# A TP larger than the visible GPU count is reported as skipped, not failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${GPU_IMAGE:-}" ]; then
    if [ -s build/gpu-image.txt ]; then GPU_IMAGE=$(cat build/gpu-image.txt)
    else GPU_IMAGE="auxcap/gpu:$("$PY" -c 'from harness.patchset.series import series_id; print(series_id())')"; fi
fi
TPS=${TPS:-"1 2 4"}
OUT=${RESULTS_DIR:-build/results/gpu}

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no GPU on this runner (nvidia-smi failed); the GPU suites need a [self-hosted, gpu] runner" >&2
    exit 3
fi
NGPU=$(nvidia-smi -L | grep -c '^GPU ')
docker image inspect "$GPU_IMAGE" >/dev/null 2>&1 || { echo "error: no image $GPU_IMAGE: run ci/build-gpu-image.sh first" >&2; exit 2; }

# Pass --tp only if this harness's test-gpu takes it; AUXCAP_TP is always set.
tp_flag=0
if docker run --rm --entrypoint python3 "$GPU_IMAGE" -m harness test-gpu --help 2>/dev/null | grep -q -- '--tp'; then tp_flag=1; fi

rm -rf "$OUT"; mkdir -p "$OUT"
summary="$OUT/summary.txt"; : > "$summary"
rc=0
for tp in $TPS; do
    if [ "$tp" -gt "$NGPU" ]; then
        echo "TP=$tp: skipped (only $NGPU GPU(s) visible)" | tee -a "$summary"
        continue
    fi
    dir="$OUT/tp$tp"; mkdir -p "$dir"
    extra=(); [ "$tp_flag" = 1 ] && extra=(--tp "$tp")
    echo "=== TP=$tp: $GPU_IMAGE test-gpu ${extra[*]} ${GPU_TEST_ARGS:-}"
    start=$(date +%s)
    set +e
    # shellcheck disable=SC2086
    docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
        -e AUXCAP_TP="$tp" -e NCCL_DEBUG="${NCCL_DEBUG:-WARN}" \
        -v "$PWD/$dir:/opt/auxcap/build/results" \
        "$GPU_IMAGE" test-gpu "${extra[@]}" ${GPU_TEST_ARGS:-}
    status=$?
    set -e
    echo "TP=$tp: exit $status in $(( $(date +%s) - start ))s" | tee -a "$summary"
    [ "$status" -eq 0 ] || rc=1
done
echo "results in $OUT:"; find "$OUT" -type f | sort
exit $rc
