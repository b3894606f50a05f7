#!/usr/bin/env bash
# check_image.py inside an image held in a buildah storage, as the image's user 10001, with networking off.
# chroot isolation shares the caller's network namespace (buildah refuses --network none with it), so the run gets
# a new, empty one from unshare: only a loopback device that is down. check_image.py verifies that.
#
# Usage (as root):  deploy/image/run_check.sh STORAGE IMAGE yes|no
#   STORAGE  a directory holding buildah's vfs storage (STORAGE/storage) and run root (STORAGE/run)
#   yes|no   whether the image ships cuBLAS (check_image.py --cublas)
set -euo pipefail
if [ $# != 3 ]; then echo "usage: $0 STORAGE IMAGE yes|no" >&2; exit 2; fi
# shellcheck source=deploy/image/storage.sh
. "$(dirname "${BASH_SOURCE[0]}")/storage.sh"
buildah_for "$1"
B=("${BUILDAH[@]}")
ctr=$("${B[@]}" from --quiet --pull=never "$2")
"${B[@]}" copy --quiet "$ctr" "$(dirname "${BASH_SOURCE[0]}")/check_image.py" /tmp/check_image.py
status=0
unshare --net -- "${B[@]}" run --isolation chroot --user 10001:10001 "$ctr" -- \
  python3 /tmp/check_image.py --cublas "$3" || status=$?
"${B[@]}" rm "$ctr" >/dev/null
exit "$status"
