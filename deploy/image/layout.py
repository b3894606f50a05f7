"""What measure.py, compare.py and push.py read of an OCI image layout (the directory `buildah push IMAGE
oci:DIR` or `skopeo copy ... oci:DIR` writes): index.json, the image manifest it names, blobs by digest.

A file that is missing or not what the image-layout spec says raises LayoutError, whose text names the file
and what is wrong; the scripts print it as one line and exit 1. Standard library only: the scripts run with
the build host's python3 and import this from their own directory.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import NamedTuple

REF_NAME = "org.opencontainers.image.ref.name"


class LayoutError(Exception):
    """A missing or malformed file in the layout; the text names it."""


class Image(NamedTuple):
    """One image of a layout: index.json's descriptor of its manifest, the manifest's bytes as stored, its
    media type (the manifest's, else the descriptor's; None when neither says), and the descriptors of its
    config and layers, each with a digest and a size."""
    entry: dict
    manifest: bytes
    media_type: str | None
    config: dict
    layers: list[dict]


def blob_path(root: Path, digest: str) -> Path:
    """The file of a blob. Only sha256 (what buildah and skopeo write); the check also keeps a digest from
    naming a path outside blobs/."""
    algo, _, hexdigest = digest.partition(":") if isinstance(digest, str) else ("", "", "")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise LayoutError(f"{root}: digest {digest!r} is not sha256:<64 hex digits>")
    return root / "blobs" / algo / hexdigest


def file_sha256(path: Path) -> str:
    """`sha256:<hex>` of a file, read in 4 MiB blocks (a layer can be hundreds of MB)."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    except OSError as e:
        raise LayoutError(f"{path}: unreadable ({e.strerror or e})") from None
    return "sha256:" + h.hexdigest()


def read_blob(root: Path, digest: str) -> bytes:
    path = blob_path(root, digest)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise LayoutError(f"{path}: missing (the layout names {digest})") from None
    except OSError as e:
        raise LayoutError(f"{path}: unreadable ({e.strerror or e})") from None


def json_object(path: Path, data: bytes) -> dict:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise LayoutError(f"{path}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise LayoutError(f"{path}: not a JSON object")
    return value


def read_json(root: Path, digest: str) -> dict:
    """A JSON blob (a manifest, a config) as a dict."""
    return json_object(blob_path(root, digest), read_blob(root, digest))


def descriptor(where: str, value: object) -> dict:
    """`value`, checked to be a descriptor: a digest string and a size in bytes."""
    size = value.get("size") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and isinstance(value.get("digest"), str) and type(size) is int
            and size >= 0):
        raise LayoutError(f"{where}: not a descriptor with a digest and a size: {str(value)[:200]}")
    return value


def read_image(root: Path, tag: str | None = None) -> Image:
    """The layout's one image; with `tag`, the one whose ref.name annotation is tag."""
    index = root / "index.json"
    try:
        entries = json_object(index, index.read_bytes()).get("manifests")
    except OSError as e:
        raise LayoutError(f"{index}: unreadable, so {root} is no OCI layout ({e.strerror or e})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise LayoutError(f"{index}: no \"manifests\" list of descriptors")
    names = [a.get(REF_NAME) if isinstance(a := e.get("annotations"), dict) else None for e in entries]
    if tag is not None:
        entries = [e for e, name in zip(entries, names) if name == tag]
    if len(entries) != 1:
        raise LayoutError(f"{index}: {len(entries)} manifests match{'' if tag is None else f' {tag!r}'}, "
                          f"expected 1 (ref.name annotations: {', '.join(map(str, names)) or 'none'})")
    entry = descriptor(f"{index}: manifests[0]", entries[0])
    path = blob_path(root, entry["digest"])
    body = read_blob(root, entry["digest"])
    manifest = json_object(path, body)
    media_type = manifest.get("mediaType") or entry.get("mediaType")
    if not isinstance(manifest.get("config"), dict) or not isinstance(manifest.get("layers"), list):
        raise LayoutError(f"{path}: not an image manifest (no config descriptor and layers list; media type "
                          f"{media_type})")
    config = descriptor(f"{path}: config", manifest["config"])
    layers = [descriptor(f"{path}: layers[{i}]", d) for i, d in enumerate(manifest["layers"])]
    return Image(entry, body, media_type, config, layers)
