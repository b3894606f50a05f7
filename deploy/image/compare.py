"""Two OCI layouts hold the same image, digest for digest: the one that was built and pushed, and the one pulled
back from the registry (`skopeo copy docker://REF oci:DIR`, which keeps the registry's blobs as they are).

    python3 deploy/image/compare.py BUILT PULLED

Compares the manifest digest, the config digest and every layer digest in order, and re-hashes every blob the
pulled layout names, so a registry or proxy that altered a byte is caught even where the names agree. Prints one
line per blob; exit status 1 on any difference, and on a missing or malformed file in either layout (one line
naming it). Standard library only: it runs on the build host.
"""

from __future__ import annotations

import sys
from pathlib import Path

from layout import LayoutError, blob_path, file_sha256, read_image


def digests(root: Path) -> list[tuple[str, str]]:
    """(role, digest) of the manifest, the config and each layer of the layout's one image."""
    image = read_image(root)
    return ([("manifest", image.entry["digest"]), ("config", image.config["digest"])]
            + [(f"layer {i}", d["digest"]) for i, d in enumerate(image.layers)])


def compare(built: Path, pulled: Path) -> int:
    a, b = digests(built), digests(pulled)
    if len(a) != len(b):
        print(f"FAIL {built} has {len(a) - 2} layers, {pulled} has {len(b) - 2}")
        return 1
    bad = 0
    for (role, want), (_, got) in zip(a, b):
        actual = file_sha256(blob_path(pulled, got))
        ok = want == got == actual
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {role}: {want}"
              + ("" if ok else f" (pulled names {got}, its bytes hash to {actual})"))
    print(f"{len(a) - bad} of {len(a)} digests the same" + ("" if not bad else f"; {bad} differ"))
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        return compare(*map(Path, argv))
    except LayoutError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
