#!/usr/bin/env bash
# Build deploy/Dockerfile without a Docker daemon and prove that the user's registry accepts it:
#   1. a Debian base made here with mmdebstrap (so the base layer is measured too, and nothing is pulled),
#   2. buildah (vfs storage, chroot isolation) builds the Dockerfile on it, one layer per instruction,
#   3. the image is pushed, gzip-compressed as a registry receives it, to an OCI layout directory,
#   4. measure.py fails if any layer blob is over the limit (default 100,000,000 bytes: the registry's proxy
#      says "100 MB", so decimal megabytes, the stricter reading), except libcublasLt's own layer (one 749 MB
#      file, ~500 MB compressed), which only ever travels in chunks (push.py),
#   5. check_image.py runs inside the image as its non-root user with networking off: `clefcore demo` must
#      answer, NVRTC must load from the wheels, and cuBLAS must load (full image) or be absent (lean image),
#   6. with CLEFCORE_IMAGE_PUSH set, publish.sh pushes the OCI layout with push.py, every request body at most
#      95,000,000 bytes (a plain `buildah push` sends a layer in one request and gets 413 for cuBLASLt's), pulls
#      it back, compares every digest and runs check_image.py inside the pulled copy; with CLEFCORE_IMAGE_PIN
#      set, writes the pushed digest into that kustomization, so the manifests pin the image by digest.
#
# Usage (as root, from anywhere):  bash deploy/image/build.sh
# It installs buildah and mmdebstrap with apt-get when they are missing. Environment:
#   CLEFCORE_IMAGE_WORK   work directory (default: a new ${TMPDIR:-/tmp}/clefcore-image.XXXXXX); the OCI
#                         layout is left in its oci/, the layer table in layers.md, the build's output in
#                         build.log
#   CLEFCORE_IMAGE_CUBLAS 1 (default): the full image, GEMMs through cuBLAS as in the benchmarks; 0: the lean
#                         image (~1.1 GB smaller unpacked, every layer under the limit, clefcore's own GEMM
#                         kernels: 1.14x-1.27x the full image's time on the H100, docs/benchmarks.md)
#   CLEFCORE_IMAGE_TAG    image tag (default: the version in pyproject.toml, plus -lean for the lean image)
#   CLEFCORE_LAYER_LIMIT  largest accepted compressed layer in bytes (default 100000000)
#   CLEFCORE_DEBIAN_MIRROR, CLEFCORE_DEBIAN_SECURITY   apt mirrors for the base (default deb.debian.org)
#   CLEFCORE_IMAGE_EPOCH  the time (seconds since 1970) of every file in the built layers and of the image's
#                         creation (default 0): same files, same layer digests, build after build
#   CLEFCORE_IMAGE_KEEP=1 keep buildah's storage (several GB) for inspection instead of deleting it
#   CLEFCORE_IMAGE_PUSH   after every check passed, push the image there with push.py, e.g.
#                         forgejo.riotpiao.com/riotpiao-poimen/clefcore:0.2.0 (log in first with
#                         `buildah login forgejo.riotpiao.com`; push.py reads the credentials it stored)
#   CLEFCORE_IMAGE_PUSH_TLS=0            push over plain HTTP (a test registry on 127.0.0.1)
#   CLEFCORE_IMAGE_PUSH_CHUNK            largest request body of the push in bytes (default 95000000)
#   CLEFCORE_IMAGE_PIN                   after the push, write its digest into this kustomization's `images`
#                                        entry (deploy/k8s/overlays/homelab/cluster/kustomization.yaml)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# a fresh directory per run by default: two checkouts building at once must not share buildah's storage
work=${CLEFCORE_IMAGE_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/clefcore-image.XXXXXX")}
cublas=${CLEFCORE_IMAGE_CUBLAS:-1}
case "$cublas" in
  1) variant="" check=yes chunked=(--chunked libcublasLt.so) ;;
  0) variant=-lean check=no chunked=() ;;
  *) echo "build.sh: CLEFCORE_IMAGE_CUBLAS must be 1 (with cuBLAS) or 0 (lean), not '$cublas'" >&2; exit 1 ;;
esac
tag=${CLEFCORE_IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")$variant}
limit=${CLEFCORE_LAYER_LIMIT:-100000000}
suite=bookworm
mirror=${CLEFCORE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${CLEFCORE_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
base=localhost/clefcore-base:$suite
image=localhost/clefcore:$tag

step() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*" >&2; }

case "${CLEFCORE_IMAGE_PUSH_TLS:-1}" in 0|1) ;;
  *) echo "build.sh: CLEFCORE_IMAGE_PUSH_TLS must be 1 (HTTPS) or 0 (plain HTTP)" >&2; exit 1 ;; esac
case "$work" in *[[:space:]]*) echo "build.sh: CLEFCORE_IMAGE_WORK must not contain spaces: $work" >&2; exit 1 ;; esac

if [ "$(id -u)" != 0 ]; then
  echo "build.sh: run as root (buildah with vfs storage and chroot isolation, mmdebstrap in root mode)" >&2
  exit 1
fi
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  step "installing buildah and mmdebstrap (apt-get)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah mmdebstrap >/dev/null
fi

mkdir -p "$work"
# A storage of our own (storage.sh): nothing else on the machine is read or changed, and cleaning up is one
# directory.
# shellcheck source=deploy/image/storage.sh
. "$repo/deploy/image/storage.sh"
buildah_for "$work"
B=("${BUILDAH[@]}")

cleanup() {
  local rc=$?
  if [ "${CLEFCORE_IMAGE_KEEP:-0}" != 1 ]; then remove_storage "$work" "$work/storage" "$work/run"; fi
  exit "$rc"
}
trap cleanup EXIT

step "base: mmdebstrap --variant=minbase $suite"
# Docs, man pages and translations are left out as in Debian's slim images; copyright files stay. The
# path-exclude settings stay in the base, so later apt-get installs are trimmed the same way. /dev is the
# container runtime's to fill.
mmdebstrap --variant=minbase --quiet \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  "$suite" - \
  "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main" \
  | mmtarfilter --path-exclude='/dev/*' > "$work/base.tar"

step "base: import as $base"
ctr=$("${B[@]}" from scratch)
"${B[@]}" add --quiet "$ctr" "$work/base.tar" /
"${B[@]}" config --created-by "mmdebstrap --variant=minbase $suite" \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
"${B[@]}" commit --quiet --rm "$ctr" "$base" >/dev/null
rm "$work/base.tar"

step "build: deploy/Dockerfile -> $image"
# pip inside the build verifies TLS against the host's CA bundle, which also covers an intercepting proxy.
secret=()
for ca in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$ca" ] && [ -s "$ca" ]; then secret=(--secret "id=ca-bundle,src=$ca"); break; fi
done
# --layers: one layer per instruction as Docker makes them (without it buildah squashes each stage into one).
# --format docker: the OCI config has no HEALTHCHECK or SHELL. --timestamp: every file in the new layers and
# the image's creation time get one fixed time (CLEFCORE_IMAGE_EPOCH, default 0), so a layer of the same files
# (cuBLAS's, NVRTC's: shared objects, no bytecode) has the same digest in every build, and push.py skips the
# ~620 MB the registry already holds. The build's output goes to build.log, each line prefixed with the seconds
# since build.sh started.
stamp() { while IFS= read -r line; do printf '[%4d] %s\n' "$SECONDS" "$line"; done; }
if ! "${B[@]}" bud --layers --isolation chroot --pull=never --format docker \
       --timestamp "${CLEFCORE_IMAGE_EPOCH:-0}" \
       -f "$repo/deploy/Dockerfile" --build-arg "BASE_IMAGE=$base" \
       --build-arg "CLEFCORE_CUBLAS=$cublas" "${secret[@]}" -t "$image" "$repo" \
       2>&1 | stamp > "$work/build.log"; then
  tail -n 60 "$work/build.log" >&2
  echo "build.sh: the build failed; its whole output is in $work/build.log" >&2
  exit 1
fi

step "push: oci:$work/oci (gzip, as a registry receives it)"
rm -rf "$work/oci"
"${B[@]}" push --quiet --compression-format gzip "$image" "oci:$work/oci:clefcore:$tag"

note=""
if [ "$cublas" = 1 ]; then note=" (but libcublasLt's own layer, pushed in chunks)"; fi
step "measure: every layer <= $limit bytes$note"
python3 "$repo/deploy/image/measure.py" "$work/oci" --limit "$limit" "${chunked[@]}" --markdown "$work/layers.md"

step "run: clefcore demo inside the image, user 10001, networking off"
bash "$repo/deploy/image/run_check.sh" "$work" "$image" "$check"

if [ -n "${CLEFCORE_IMAGE_PUSH:-}" ]; then
  bash "$repo/deploy/image/publish.sh" "$work/oci" "$CLEFCORE_IMAGE_PUSH"
fi

step "image OK: $image, layers in $work/layers.md, OCI layout in $work/oci"
