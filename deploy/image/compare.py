"""Two OCI layouts hold the same image, digest for digest: the one that was built and pushed, and the one pulled
back from the registry (`skopeo copy docker://REF oci:DIR`, which keeps the registry's blobs as they are).

    python3 deploy/image/compare.py BUILT PULLED

Compares the manifest digest, the config digest and every layer digest in order, and re-hashes every blob the
pulled layout names, so a registry or proxy that altered a byte is caught even where the names agree. Prints one
line per blob; exit status 1 on any difference. Standard library only: it runs on the build host.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def blob(layout: Path, digest: str) -> Path:
    algo, hexdigest = digest.split(":", 1)
    return layout / "blobs" / algo / hexdigest


def image(layout: Path) -> list[tuple[str, str]]:
    """(role, digest) of the manifest, the config and each layer of the layout's one image."""
    manifests = json.loads((layout / "index.json").read_text())["manifests"]
    if len(manifests) != 1:
        raise SystemExit(f"{layout}: expected one image in the layout, found {len(manifests)}")
    digest = manifests[0]["digest"]
    manifest = json.loads(blob(layout, digest).read_bytes())
    return ([("manifest", digest), ("config", manifest["config"]["digest"])]
            + [(f"layer {i}", d["digest"]) for i, d in enumerate(manifest["layers"])])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    built, pulled = map(Path, argv)
    a, b = image(built), image(pulled)
    bad = 0
    if len(a) != len(b):
        print(f"FAIL {built} has {len(a) - 2} layers, {pulled} has {len(b) - 2}")
        return 1
    for (role, want), (_, got) in zip(a, b):
        actual = sha256(blob(pulled, got))
        ok = want == got == actual
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {role}: {want}"
              + ("" if ok else f" (pulled names {got}, its bytes hash to {actual})"))
    print(f"{len(a) - bad} of {len(a)} digests the same" + ("" if not bad else f"; {bad} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
