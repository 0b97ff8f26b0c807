#!/usr/bin/env bash
# Build the Tandem image from deploy/k8s/Dockerfile with buildah (no Docker daemon needed): `make image`.
#
# Environment (all optional):
#   TANDEM_IMAGE        the tag to build               (default localhost/tandem:0.1.0)
#   TANDEM_IMAGE_BASE   the Python base image          (default: a local Debian bookworm base,
#                       made once with debootstrap from Debian's packages and kept as
#                       localhost/tandem-base:bookworm; set python:3.11-slim where a registry is reachable)
#   TORCH_INDEX_URL     a PyTorch index for torch      (default: the local CPU wheel, see below;
#                       e.g. https://download.pytorch.org/whl/cu128 for the CUDA variant)
#   WITH_CC             1: ship a C compiler for our CPU kernels (default), 0: a smaller image
#   IMAGE_BUILD_ARGS    more arguments for `buildah bud`
#
# torch: unless TORCH_INDEX_URL is set, a torch-2.13.0+cpu wheel from $PIP_FIND_LINKS (or
# /opt/wheels) is linked into deploy/k8s/wheels/, which the Dockerfile installs instead of reaching
# the PyTorch index. Builds behind a TLS-inspecting proxy: the host's /etc/ssl/certs is mounted
# read-only into the build's RUN steps (nothing of it is stored in the image).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TANDEM_IMAGE:-localhost/tandem:0.1.0}
BASE=${TANDEM_IMAGE_BASE:-localhost/tandem-base:bookworm}
WITH_CC=${WITH_CC:-1}

[ "$(id -u)" = 0 ] || { echo "make image: buildah needs root here (run as root)" >&2; exit 1; }
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "make image: $tool is missing: apt-get install -y buildah debootstrap" >&2; exit 1; }
done

if [ "$BASE" = localhost/tandem-base:bookworm ] && ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "== base: Debian bookworm with python3.11 by debootstrap (once; kept as $BASE)"
  root=$(mktemp -d /var/tmp/tandem-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root/rootfs" http://deb.debian.org/debian >"$root/debootstrap.log" 2>&1 \
    || { tail -20 "$root/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/lib/apt/lists/*
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$root/rootfs/." "$mnt/"
  buildah umount "$ctr" >/dev/null
  # PIP_CERT: pip (23.0 in bookworm) reads certifi's bundle, not the system's, unless told.
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd /bin/bash "$ctr"
  buildah commit --rm "$ctr" "$BASE" >/dev/null
fi

args=(--build-arg "PYTHON_IMAGE=$BASE" --build-arg "WITH_CC=$WITH_CC")
rm -f deploy/k8s/wheels/torch-*.whl
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
else
  wheel=$(ls "${PIP_FIND_LINKS:-/opt/wheels}"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    ln -f "$wheel" deploy/k8s/wheels/ 2>/dev/null || cp "$wheel" deploy/k8s/wheels/
    echo "== torch from $wheel"
  fi
fi
[ -d /etc/ssl/certs ] && args+=(-v /etc/ssl/certs:/etc/ssl/certs:ro)

echo "== buildah bud -> $TAG (base $BASE)"
start=$(date +%s)
# shellcheck disable=SC2086
buildah bud --isolation chroot --layers "${args[@]}" ${IMAGE_BUILD_ARGS:-} \
  --ignorefile deploy/k8s/Dockerfile.dockerignore -f deploy/k8s/Dockerfile -t "$TAG" .
rm -f deploy/k8s/wheels/torch-*.whl
echo "== built $TAG in $(( $(date +%s) - start )) s:"
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG"
