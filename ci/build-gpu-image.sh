#!/usr/bin/env bash
# Build the GPU test image (docker/Dockerfile, target gpu) on a GPU CI runner.
# Base: lmsysorg/sglang:v0.5.13.post1 (SGLang as a git checkout at /sgl-workspace/sglang);
# the series is applied onto it with `python -m harness.docker apply-onto`.
#
# env: GPU_BASE (base image), GPU_IMAGE (tag; default auxcap/gpu:<series id>),
#      ALLOW_BASE_MISMATCH=1 (checkout HEAD may differ from pin.json's commit),
#      SSL_CERT_FILE (CA bundle passed as a BuildKit secret, never stored in a layer).
# Prints the image tag on its last line and writes it to build/gpu-image.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SID=$("$PY" -c 'from harness.patchset.series import series_id; print(series_id())')
GPU_BASE=${GPU_BASE:-lmsysorg/sglang:v0.5.13.post1}
TAG=${GPU_IMAGE:-auxcap/gpu:$SID}
TMP="$TAG-build$$"
CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}

command -v docker >/dev/null || { echo "error: no docker client on this runner" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "error: no Docker engine answers on this runner (docker info failed)" >&2; exit 2; }

args=(-f docker/Dockerfile --target gpu --progress plain
      --build-arg "GPU_BASE=$GPU_BASE" --build-arg "SERIES_ID=$SID"
      --build-arg "ALLOW_BASE_MISMATCH=${ALLOW_BASE_MISMATCH:-0}" -t "$TMP")
if [ -s "$CA" ]; then args+=(--secret "id=ca,src=$CA"); fi

echo "building $TAG from $GPU_BASE (series $SID)"
start=$(date +%s)
if ! DOCKER_BUILDKIT=1 docker build "${args[@]}" .; then
    docker image rm "$TMP" >/dev/null 2>&1 || true
    echo "error: GPU image build failed (series $SID, base $GPU_BASE); see the step output above" >&2
    exit 1
fi
docker tag "$TMP" "$TAG"
docker image rm "$TMP" >/dev/null
got=$(docker image inspect --format '{{ index .Config.Labels "org.auxcap.series-id" }}' "$TAG")
[ "$got" = "$SID" ] || { echo "error: $TAG carries series id '$got', expected $SID" >&2; exit 1; }
mkdir -p build
echo "$TAG" > build/gpu-image.txt
echo "built in $(( $(date +%s) - start ))s:"
echo "$TAG"
