"""Layer sizes of an image in an OCI layout directory (what `buildah push ... oci:DIR` writes), checked against
a registry's per-layer limit.

    python3 deploy/image/measure.py DIR [--limit BYTES] [--chunked FILENAME] [--markdown FILE]

Each layer's compressed size is the size of its blob file, the bytes a registry receives; it must equal the
size the manifest declares. "files" is the bytes of the regular files inside; "largest parts" names where
most of them are; the instruction that made each layer comes from the image config's history.
Exit status 1 when any layer is over the limit, except a layer whose regular files are all named FILENAME*
(--chunked, repeatable): such a layer is exempt because it cannot be made smaller (one file over the limit),
and it reaches the registry only through deploy/image/push.py's chunked upload. A missing or malformed file in
the layout is one line naming it, exit status 1. Standard library only: it runs on the build host.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

from layout import LayoutError, blob_path, read_image, read_json

MB = 1000 * 1000


def group(name: str) -> str:
    """Where a file's bytes are counted: the package under site-packages, else the first two directories."""
    parts = name.lstrip("./").split("/")
    if "site-packages" in parts[:-1]:
        return "site-packages/" + parts[parts.index("site-packages") + 1]
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def contents(path: Path) -> tuple[int, Counter, set[str]]:
    """Bytes of regular files in a layer blob (streamed, gzip), in all and per group; the files' names."""
    sizes: Counter = Counter()
    names = set()
    try:
        with tarfile.open(path, mode="r|gz") as tar:
            for member in tar:
                if member.isfile():
                    sizes[group(member.name)] += member.size
                    names.add(member.name.rsplit("/", 1)[-1])
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise LayoutError(f"{path}: not a readable gzip tar ({e})") from None
    return sum(sizes.values()), sizes, names


def describe(created_by: str) -> str:
    """A history entry shortened to the instruction and its first words."""
    text = " ".join(created_by.replace("/bin/sh -c #(nop) ", "").replace("|", "/").split())
    return text if len(text) <= 60 else text[:57] + "..."


def holds(sizes: Counter, n: int = 3) -> str:
    return ", ".join(f"{name} {size / MB:.1f} MB" for name, size in sizes.most_common(n) if size)


def layers(root: Path, chunked: tuple[str, ...] = ()) -> list[dict]:
    image = read_image(root)
    config = read_json(root, image.config["digest"])
    history = config["history"] if isinstance(config.get("history"), list) else []
    made = [h.get("created_by", "") for h in history if isinstance(h, dict) and not h.get("empty_layer")]
    if len(made) != len(image.layers):   # history is optional in OCI; say so rather than guess
        made = ["(no history)"] * len(image.layers)
    out = []
    for i, (desc, created_by) in enumerate(zip(image.layers, made)):
        path = blob_path(root, desc["digest"])
        try:
            size = path.stat().st_size
        except OSError as e:
            raise LayoutError(f"{path}: layer {i}: {e.strerror}") from None
        if size != desc["size"]:
            raise LayoutError(f"{path}: layer {i} has {size} bytes, the manifest says {desc['size']}")
        if "gzip" not in str(desc.get("mediaType")):
            raise LayoutError(f"{path}: layer {i} is {desc.get('mediaType')}, not gzip-compressed")
        unpacked, sizes, names = contents(path)
        out.append({"index": i, "digest": desc["digest"], "compressed": size, "unpacked": unpacked,
                    "holds": holds(sizes), "created_by": describe(str(created_by)),
                    "chunked": bool(names) and bool(chunked) and all(n.startswith(chunked) for n in names)})
    return out


def table(rows: list[dict], limit: int) -> str:
    lines = ["| # | compressed | files | largest parts | made by |", "|---:|---:|---:|---|---|"]
    for r in rows:
        flag = ("" if r["compressed"] <= limit else " (pushed in chunks)" if r["chunked"]
                else " **over the limit**")
        lines.append(f"| {r['index']} | {r['compressed'] / MB:.1f} MB{flag} | {r['unpacked'] / MB:.1f} MB "
                     f"| {r['holds']} | `{r['created_by']}` |")
    total_c = sum(r["compressed"] for r in rows)
    total_u = sum(r["unpacked"] for r in rows)
    lines.append(f"| all | {total_c / MB:.1f} MB | {total_u / MB:.1f} MB | | {len(rows)} layers; limit "
                 f"{limit / MB:g} MB = {limit} bytes each |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", type=Path, help="OCI layout directory")
    p.add_argument("--limit", type=int, default=100 * MB, help="largest accepted compressed layer, bytes")
    p.add_argument("--chunked", action="append", default=[], metavar="FILENAME",
                   help="a layer holding only files named FILENAME* may exceed the limit (pushed in chunks)")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = p.parse_args(argv)
    try:
        rows = layers(args.layout, tuple(args.chunked))
    except LayoutError as e:
        print(f"measure.py: {e}", file=sys.stderr)
        return 1
    text = table(rows, args.limit)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    over = [r for r in rows if r["compressed"] > args.limit and not r["chunked"]]
    for r in over:
        print(f"layer {r['index']} ({r['digest']}) is {r['compressed']} bytes, over the {args.limit}-byte "
              "limit", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
