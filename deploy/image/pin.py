"""Pin an image by digest in a kustomization: the `images` entry for NAME gets `digest: DIGEST`, which kustomize
renders as `newName:newTag@DIGEST`, so a cluster runs exactly the image that was pushed (the tag stays, for
people to read). publish.sh calls it with the digest the registry acknowledged, when CLEFCORE_IMAGE_PIN names the
kustomization.

    python3 deploy/image/pin.py KUSTOMIZATION DIGEST [--name clefcore]

A line edit, so that the file's comments and order stay as written (the build host need not have PyYAML): the
entry must be a block mapping starting `- name: NAME` under a top-level `images:` key.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class PinError(Exception):
    pass


def pin(text: str, name: str, digest: str) -> str:
    """``text`` with the ``images`` entry of ``name`` pinned to ``digest`` (replacing an earlier pin)."""
    if not DIGEST.fullmatch(digest):
        raise PinError(f"{digest!r} is not a sha256 digest (sha256: and 64 hex digits)")
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if re.fullmatch(r"images:\s*", line))
    except StopIteration:
        raise PinError("no top-level `images:` key") from None
    entry = None
    for i in range(start + 1, len(lines)):
        if lines[i].strip() and not lines[i].startswith((" ", "-", "#")):
            break                                     # the next top-level key: the images list ended
        if re.fullmatch(rf"(\s*)- name: {re.escape(name)}\s*", lines[i]):
            entry = i
            break
    if entry is None:
        raise PinError(f"no `- name: {name}` entry under `images:`")
    indent = " " * (lines[entry].index("-") + 2)     # the entry's keys line up after "- "
    end = entry + 1
    while end < len(lines) and lines[end].startswith(indent) and not lines[end][len(indent)].isspace():
        end += 1
    body = [line for line in lines[entry + 1:end] if not line.startswith(indent + "digest:")]
    return "".join(lines[:entry + 1] + body + [f"{indent}digest: {digest}\n"] + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pin.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("kustomization", type=Path)
    parser.add_argument("digest")
    parser.add_argument("--name", default="clefcore", help="the image name the manifests use (default: clefcore)")
    args = parser.parse_args(argv)
    try:
        args.kustomization.write_text(pin(args.kustomization.read_text(), args.name, args.digest))
    except (PinError, OSError) as error:
        sys.stderr.write(f"pin.py: {args.kustomization}: {error}\n")
        return 1
    sys.stderr.write(f"pin.py: {args.kustomization}: {args.name} pinned to {args.digest}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
