#!/usr/bin/env bash
# Exercise the GPU target of docker/Dockerfile on a machine without the upstream image
# (no registry) or a GPU: build a stand-in for lmsysorg/sglang (the CPU deps stage + the
# pristine pin as a git checkout at /sgl-workspace/sglang), build `--target gpu` on it,
# and check that its entrypoint refuses to run test-gpu without a GPU, in one line.
# Needs the CPU base (`python -m harness docker-base`) and build/sglang (`make apply-patches`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DOCKER=${AUXCAP_DOCKER:-docker}
if [ -x /usr/bin/docker ] && ! docker buildx version >/dev/null 2>&1; then DOCKER=/usr/bin/docker; fi
export DOCKER_BUILDKIT=1
SID=$("$PY" -c 'from harness.patchset.series import series_id; print(series_id())')
CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
secret=(); if [ -s "$CA" ]; then secret=(--secret "id=ca,src=$CA"); fi
[ -d build/sglang/.git ] || { echo "error: build/sglang missing: run make apply-patches first" >&2; exit 2; }

ctx=build/gpu-smoke
rm -rf "$ctx"; mkdir -p "$ctx"
git clone -q build/sglang "$ctx/sglang"
git -C "$ctx/sglang" -c advice.detachedHead=false checkout -q "base/v$("$PY" -c 'import json; print(json.load(open("patches/pin.json"))["version"])')"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM auxcap/cpu-deps:smoke
RUN --mount=type=secret,id=ca,target=/run/secrets/ca.crt \
    if [ -s /run/secrets/ca.crt ]; then export SSL_CERT_FILE=/run/secrets/ca.crt; fi; \
    uv pip install --quiet --python /opt/venv/bin/python pip setuptools wheel
COPY sglang /sgl-workspace/sglang
# the wheel-derived tree has no build config; an untracked stand-in keeps the checkout clean
RUN printf '%s\n' '[build-system]' 'requires = ["setuptools>=61"]' 'build-backend = "setuptools.build_meta"' \
      '[project]' 'name = "sglang"' 'version = "0.5.13.post1"' \
      '[tool.setuptools.packages.find]' 'include = ["sglang*"]' > /sgl-workspace/sglang/python/pyproject.toml
DOCKERFILE

"$DOCKER" build -q -f docker/Dockerfile --target cpu-deps --network host "${secret[@]}" -t auxcap/cpu-deps:smoke . >/dev/null
"$DOCKER" build -q --network host "${secret[@]}" -t auxcap/fake-gpu-base:smoke "$ctx" >/dev/null
"$DOCKER" build --progress plain -f docker/Dockerfile --target gpu --network host "${secret[@]}" \
    --build-arg GPU_BASE=auxcap/fake-gpu-base:smoke --build-arg ALLOW_BASE_MISMATCH=1 \
    --build-arg SERIES_ID="$SID" -t auxcap/gpu:smoke . 2>&1 | grep -E 'applied|\[[0-9]+/[0-9]+\]|sglang .* from|warning:|error' || true
"$DOCKER" image inspect auxcap/gpu:smoke >/dev/null 2>&1 || { echo "error: GPU target did not build" >&2; exit 1; }
set +e
out=$("$DOCKER" run --rm auxcap/gpu:smoke 2>&1); rc=$?
set -e
echo "docker run auxcap/gpu:smoke -> exit $rc: $out"
if [ "$rc" -ne 3 ] || [[ "$out" != *"needs a GPU"* ]]; then
    echo "error: GPU entrypoint did not refuse cleanly" >&2; exit 1
fi
label=$("$DOCKER" image inspect --format '{{ index .Config.Labels "org.auxcap.series-id" }}' auxcap/gpu:smoke)
[ "$label" = "$SID" ] || { echo "error: label $label != $SID" >&2; exit 1; }
echo "GPU target smoke ok (series $SID)"
