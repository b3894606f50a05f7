#!/usr/bin/env bash
# Push a built OCI layout to a registry and prove what the cluster will pull:
#   1. push.py uploads every blob in chunks (each request body at most CLEFCORE_IMAGE_PUSH_CHUNK, default
#      95,000,000 bytes: the registry's proxy refuses bodies over 100 MB), the manifest last;
#   2. skopeo pulls the image back into a second layout, keeping the registry's blobs as they are;
#   3. compare.py: the manifest, config and every layer digest are the ones built, every pulled blob re-hashed;
#   4. the pulled image is imported into a buildah storage of its own (nothing of the build's is reused) and
#      check_image.py runs inside it as user 10001 with networking off;
#   5. with CLEFCORE_IMAGE_PIN set to a kustomization (deploy/k8s/overlays/homelab/cluster/kustomization.yaml),
#      pin.py writes the pushed digest into its `images` entry: the manifests then run exactly this image.
#
# Usage (as root):  bash deploy/image/publish.sh OCI_DIR REF     e.g. REF=forgejo.riotpiao.com/owner/clefcore:0.2.0
# build.sh runs it when CLEFCORE_IMAGE_PUSH is set. Log in first (`buildah login HOST`): push.py and skopeo read
# the credentials it stored. Environment:
#   CLEFCORE_IMAGE_CUBLAS      1 (default): the image ships cuBLAS; 0: the lean image (what check_image.py expects)
#   CLEFCORE_IMAGE_PUSH_TLS=0  plain HTTP (a test registry on 127.0.0.1)
#   CLEFCORE_IMAGE_PUSH_CHUNK  largest request body of the push, bytes
#   CLEFCORE_IMAGE_PIN         a kustomization to pin the pushed digest in (step 5)
set -euo pipefail
if [ $# != 2 ]; then echo "usage: $0 OCI_DIR REF" >&2; exit 2; fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
layout=$1
ref=${2#docker://}
case "${CLEFCORE_IMAGE_CUBLAS:-1}" in 1) check=yes ;; 0) check=no ;;
  *) echo "publish.sh: CLEFCORE_IMAGE_CUBLAS must be 1 or 0" >&2; exit 2 ;; esac
case "${CLEFCORE_IMAGE_PUSH_TLS:-1}" in 1) tls=true ;; 0) tls=false ;;
  *) echo "publish.sh: CLEFCORE_IMAGE_PUSH_TLS must be 1 or 0" >&2; exit 2 ;; esac
if ! command -v skopeo >/dev/null || ! command -v buildah >/dev/null; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q skopeo buildah >/dev/null
fi
step() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*" >&2; }

pulled=$(mktemp -d "${TMPDIR:-/tmp}/clefcore-pulled.XXXXXX")
# shellcheck source=deploy/image/storage.sh
. "$here/storage.sh"
cleanup() {
  local rc=$?
  remove_storage "$pulled" "$pulled"
  exit "$rc"
}
trap cleanup EXIT

step "push: $ref (deploy/image/push.py, in chunks)"
python3 "$here/push.py" "$layout" "$ref" --digestfile "$pulled/pushed.digest"
digest=$(cat "$pulled/pushed.digest")

step "pull back: skopeo copy docker://$ref -> a second layout, every digest compared"
skopeo copy --quiet --src-tls-verify="$tls" "docker://$ref" "oci:$pulled/oci:clefcore:pulled"
python3 "$here/compare.py" "$layout" "$pulled/oci"

step "run: clefcore demo inside the pulled image (a storage of its own), user 10001, networking off"
skopeo copy --quiet "oci:$pulled/oci:clefcore:pulled" \
  "containers-storage:[vfs@$pulled/storage+$pulled/run]localhost/clefcore-pulled:latest"
bash "$here/run_check.sh" "$pulled" localhost/clefcore-pulled:latest "$check"
echo "pushed $ref@$digest" >&2
if [ -n "${CLEFCORE_IMAGE_PIN:-}" ]; then
  step "pin: $digest in $CLEFCORE_IMAGE_PIN"
  python3 "$here/pin.py" "$CLEFCORE_IMAGE_PIN" "$digest"
fi
