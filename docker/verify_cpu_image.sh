#!/usr/bin/env bash
# Builds docker/Dockerfile.cpu and checks that the image starts the server and answers, on a Debian
# machine WITHOUT a Docker engine and without Docker Hub or download.pytorch.org (PyPI and the
# Debian mirror must be reachable). Run as root from anywhere:  bash docker/verify_cpu_image.sh
#
# What it proves: the Dockerfile as written (its RUN steps, the .dockerignore'd context, the
# ENTRYPOINT) builds into an OCI image in which `python -m sglang_vericache.launch_server` starts
# with no arguments (the bundled model), and /generate and /v1/completions return non-empty text.
#
# What it substitutes, so read the result with these in mind:
#   - podman (daemonless; vfs storage, chroot build isolation, host network, runc) stands in for
#     `docker build` / `docker run`. The Dockerfile is the same file a Docker user builds.
#   - BASE_IMAGE: python:3.11-slim cannot be pulled here, so a stand-in is made locally: Debian
#     bookworm (debootstrap minbase) with its python3 3.11 and a venv at /usr/local, so that
#     `python`/`pip` at /usr/local/bin behave as in python:3.11-slim (which is also Debian bookworm,
#     but with its own CPython build). It is tagged localhost/python:3.11-slim.
#   - torch: the PyTorch CPU index cannot be reached, so torch is installed from a local folder
#     holding the CPU wheel (WHEELS, default /opt/wheels), mounted into the build, via the
#     Dockerfile's TORCH_PIP_ARGS / TORCH_VERSION build args. Without that folder the Dockerfile's
#     default (the PyTorch CPU index) is used. Everything else comes from PyPI as in a normal build.
#   - TLS: this machine reaches PyPI through a proxy whose CA is only in the host's bundle, so the
#     host's /etc/ssl/certs/ca-certificates.crt (HOST_CA; HOST_CA=none to skip) is bind-mounted over
#     the base's during the build (the stand-in's pip, Debian's, reads that file). Not in the image.
# Machine quirks handled (a sandbox VM): cgroups v1/v2 hybrid (crun refuses; runc with cgroupfs
# works), no CAP_SYS_RESOURCE (the container's rlimits are pinned at or below the host's).
#
# Env: PORT (30123), TAG, WHEELS, HOST_CA, TORCH_VERSION (2.13.0+cpu with WHEELS), MIRROR, WORK (scratch
# folder for the base rootfs, removed at the end), REBUILD_BASE=1 to remake the stand-in base,
# KEEP_IMAGE=0 to remove the built image at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-30123}
TAG=${TAG:-localhost/sglang-vericache:cpu}
BASE_TAG=localhost/python:3.11-slim
WHEELS=${WHEELS:-/opt/wheels}
# the Debian mirror this machine's apt already uses (its first .../debian URI)
MIRROR=${MIRROR:-$(grep -rhoE '^(deb|URIs:) +https?://[^ ]+/debian/?$|^(deb|URIs:) +https?://[^ ]+/debian ' \
  /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -1 | awk '{print $2}')}
[ -n "$MIRROR" ] || { echo "no Debian mirror found in /etc/apt sources: set MIRROR" >&2; exit 1; }
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
WORK=${WORK:-/tmp/vc-image-verify}
NAME=vc-verify-$$
LOG=$WORK/server.log

step() { echo "== $(date +%T) $*"; }
die() { echo "FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (apt-get, debootstrap, rootful podman)"

# ---- 1. tools: podman (+ runc) and debootstrap from apt
missing=()
for c in podman runc debootstrap curl python3; do command -v "$c" >/dev/null || missing+=("$c"); done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt-get install podman runc debootstrap curl python3"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap curl python3 >/dev/null
fi
P=(podman --storage-driver vfs --cgroup-manager cgroupfs --events-backend file)
mkdir -p "$WORK"

cleanup() {
  "${P[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
  rm -rf "$WORK/rootfs"
  if [ "${KEEP_IMAGE:-1}" = 0 ]; then "${P[@]}" rmi -f "$TAG" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# ---- 2. the stand-in base image: Debian bookworm + python3.11, venv at /usr/local
if [ "${REBUILD_BASE:-0}" = 1 ] || ! "${P[@]}" image exists "$BASE_TAG"; then
  step "debootstrap bookworm from $MIRROR"
  rm -rf "$WORK/rootfs"
  nice -n 10 debootstrap --variant=minbase --include=python3-venv,ca-certificates \
    bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -5 "$WORK/debootstrap.log"; die "debootstrap"; }
  chroot "$WORK/rootfs" /usr/bin/python3 -m venv /usr/local   # python, pip in /usr/local/bin
  chroot "$WORK/rootfs" /usr/local/bin/python -c "import sys, ssl; assert sys.version_info[:2] == (3, 11)"
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  step "import as $BASE_TAG"
  tar -C "$WORK/rootfs" -c . | "${P[@]}" import -q \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
  rm -rf "$WORK/rootfs"
fi

# ---- 3. build docker/Dockerfile.cpu
build_args=(--build-arg "BASE_IMAGE=$BASE_TAG")
vol=()
if compgen -G "$WHEELS/torch-*cp311*.whl" >/dev/null; then
  build_args+=(--build-arg "TORCH_PIP_ARGS=--find-links /wheels"
               --build-arg "TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}")
  vol=(-v "$(realpath "$WHEELS"):/wheels:ro")
  step "torch from local wheels in $WHEELS"
fi
if [ -f "$HOST_CA" ]; then  # a TLS-intercepting proxy's CA lives only in the host's bundle
  vol+=(-v "$HOST_CA:/etc/ssl/certs/ca-certificates.crt:ro")
  step "build sees the host's CA bundle $HOST_CA (build-time mount, not in the image)"
fi
step "podman build -f docker/Dockerfile.cpu -t $TAG (log: $WORK/build.log)"
t0=$(date +%s)
if ! nice -n 10 "${P[@]}" build --isolation chroot --network host "${vol[@]}" "${build_args[@]}" \
     -f docker/Dockerfile.cpu -t "$TAG" . >"$WORK/build.log" 2>&1; then
  tail -20 "$WORK/build.log"; die "build"
fi
grep -E "^STEP|^torch |^COMMIT" "$WORK/build.log" || true
echo "build: $(( $(date +%s) - t0 )) s; image size: $("${P[@]}" image inspect "$TAG" --format '{{.Size}}' \
  | awk '{printf "%.2f GB", $1/1e9}')"

# ---- 4. run it with its default entrypoint (bundled model), only the port changed
step "podman run $TAG --port $PORT"
t0=$(date +%s)
"${P[@]}" run -d --name "$NAME" --runtime runc --network host \
  --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=32768:32768 \
  "$TAG" --port "$PORT" >/dev/null
step "container started after $(( $(date +%s) - t0 )) s (vfs copies the image for each container)"
url=http://127.0.0.1:$PORT
for i in $(seq 1 180); do
  curl -sf "$url/health" >/dev/null && break
  [ "$("${P[@]}" inspect -f '{{.State.Running}}' "$NAME")" = true ] \
    || { "${P[@]}" logs "$NAME" | tail -20; die "container exited"; }
  sleep 2
done
curl -sf "$url/health" >/dev/null || { "${P[@]}" logs "$NAME" | tail -20; die "no /health after 360 s"; }
step "server healthy $(( $(date +%s) - t0 )) s after podman run"

gen=$(curl -s "$url/generate" -H 'Content-Type: application/json' \
  -d '{"text":"def add(a, b):","sampling_params":{"max_new_tokens":16,"temperature":0}}')
echo "/generate -> $gen"
python3 -c 'import json,sys; t=json.loads(sys.argv[1])["text"]; assert t.strip(), "empty text"' "$gen" \
  || die "/generate gave no text"
model=$(curl -s "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
cmp=$(curl -s "$url/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$model\",\"prompt\":\"def add(a, b):\",\"max_tokens\":16,\"temperature\":0}")
echo "/v1/completions ($model) -> $cmp"
python3 -c 'import json,sys; t=json.loads(sys.argv[1])["choices"][0]["text"]; assert t.strip(), "empty text"' "$cmp" \
  || die "/v1/completions gave no text"
"${P[@]}" logs "$NAME" >"$LOG" 2>&1 || true
step "PASS: $TAG serves the bundled model (container log: $LOG)"
