# shellcheck shell=bash
# Sourced by the image scripts (build.sh, run_check.sh, publish.sh, .ci/image): buildah on a vfs storage of its
# own under a directory, so that nothing else on the machine is read or changed, and that storage's removal.

# buildah_for DIR: BUILDAH becomes the buildah command (an array, so that unshare can run it too) whose storage
# and run root are under DIR
buildah_for() {
  # shellcheck disable=SC2034  # set for the caller
  BUILDAH=(buildah --root "$1/storage" --runroot "$1/run" --storage-driver vfs)
}

# remove_storage DIR PATH...: every container and image gone from DIR's storage, then PATH... deleted, unless a
# mount that a failed run left behind remains under DIR (never delete through a mount)
remove_storage() {
  local dir=$1 BUILDAH
  shift
  buildah_for "$dir"
  "${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true
  "${BUILDAH[@]}" rmi --all --force >/dev/null 2>&1 || true
  if grep -qF " $dir/" /proc/self/mountinfo; then
    echo "$(basename "$0"): mounts remain under $dir; left in place" >&2
  else
    rm -rf --one-file-system "$@"
  fi
}
