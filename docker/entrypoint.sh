#!/bin/sh
# Entry point of the auxcap images: `docker run IMAGE VERB [ARGS...]` runs
# `python -m harness VERB ARGS...` in /opt/auxcap (results land in build/results/,
# mount a host folder there).  VERB defaults to `test` (CPU) / `test-gpu` (GPU).
set -eu
cd "${AUXCAP_HOME:-/opt/auxcap}"
if [ $# -eq 0 ]; then
    if [ "${AUXCAP_IMAGE_KIND:-cpu}" = gpu ]; then set -- test-gpu; else set -- test; fi
fi
case "$1" in
    sh|bash|shell) shift; exec /bin/bash "$@" ;;
esac
PY=python3
command -v "$PY" >/dev/null 2>&1 || PY=python

needs_gpu=0
case "$1" in test-gpu) needs_gpu=1 ;; esac
if [ "${AUXCAP_IMAGE_KIND:-cpu}" = gpu ] && [ "$1" = ablation ]; then needs_gpu=1; fi

if [ "$needs_gpu" = 1 ]; then
    if ! nvidia-smi -L >/dev/null 2>&1; then
        echo "error: $1 needs a GPU, but none is visible in this container (nvidia-smi failed): run on a GPU host with the NVIDIA container toolkit and \`docker run --gpus all ...\`" >&2
        exit 3
    fi
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
        echo "error: $1 needs a GPU: nvidia-smi sees one but torch.cuda.is_available() is False (driver/CUDA mismatch?)" >&2
        exit 3
    fi
fi
exec "$PY" -m harness "$@"
