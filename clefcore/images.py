"""The ``images`` field on the wire: parse the items, enforce the limits, decode to RGB (protocol §3.7,
clef-images.md §1-2).

Two forms per item: a data URL (``data:`` in any case, ``image/png|jpeg|jpg|webp``, ``;base64,``) or an object
``{"content_type", "base64"}``. Nothing else is read: no paths, no URLs, no bare base64 (the reference opens
paths and fetches URLs; a server must never do either with a client's string).

Decoding is bounded: the payload size is known from the base64 length before it is decoded, and Pillow's lazy
``open`` reads only the header, so the pixel count is checked before any pixel is decompressed.

Pillow is the decoder because it decodes all six fixture images (PNG RGB/RGBA/palette, JPEG RGB/grayscale,
lossy WebP) to exactly the RGB the reference's decoder (torchvision.io.decode_image) gives (clef-images.md §2),
and it can report the size before decoding.
"""

from __future__ import annotations

import binascii
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import RequestError

MAX_IMAGES = 4
MAX_IMAGE_BYTES = 4 * 1024 * 1024           # one image's file bytes (after base64)
MAX_TOTAL_BYTES = 8 * 1024 * 1024           # all images' file bytes together
MAX_PIXELS = 16_000_000                     # measured: 16.00 MP accepted, 16.38 MP refused (protocol §3.7)
MAX_ASPECT = 200                            # smart_resize raises beyond this ratio (clef-images.md §3)
CONTENT_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
FORMATS = ("PNG", "JPEG", "WEBP")           # what Pillow may sniff; the MIME type is not trusted for this
# Pixel formats whose conversion to 8-bit RGB is the reference's (alpha dropped, palette and grey expanded).
# 16-bit, CMYK and float images are refused: their conversion is not pinned by any fixture.
MODES = ("1", "L", "LA", "P", "RGB", "RGBA")
ORIENTATION = 0x0112                        # the EXIF tag exif_transpose acts on

_DATA_URL = re.compile(r"[Dd][Aa][Tt][Aa]:([^;,]*);base64,(.*)", re.DOTALL)
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _refuse(field: str, message: str, limit: str | None = None) -> RequestError:
    return RequestError(f"{field}: {message}", field=field, limit=limit)


def _payload_size(b64: str, field: str) -> int:
    """File bytes that ``b64`` decodes to, from its length alone (so an oversized payload is never decoded)."""
    if len(b64) % 4 or not _BASE64.fullmatch(b64):
        raise _refuse(field, "image payload is not valid base64 (standard alphabet, padded, no whitespace)")
    return len(b64) // 4 * 3 - (len(b64) - len(b64.rstrip("=")))


def parse_item(item: Any, index: int) -> tuple[str, str]:
    """One wire item -> (content type, base64 payload); refuses every other form, naming ``images[index]``."""
    field = f"images[{index}]"
    if isinstance(item, str):
        m = _DATA_URL.fullmatch(item)
        if m is None:
            what = ("a URL" if re.match(r"(?i)[a-z][a-z0-9+.-]*://", item) else "not a data URL")
            raise _refuse(field, f"must be a data URL (data:image/png|jpeg|webp;base64,...) or an object "
                                 f"{{content_type, base64}}; got {what} (paths, URLs and bare base64 are not read)",
                          limit="data URL or {content_type, base64}")
        content_type, b64 = m.group(1), m.group(2)
    elif isinstance(item, dict):
        extra = sorted(set(item) - {"content_type", "base64"})
        if extra:
            raise _refuse(f"{field}.{extra[0]}", "unknown field (allowed: content_type, base64)")
        for key in ("content_type", "base64"):
            if not isinstance(item.get(key), str):
                raise _refuse(f"{field}.{key}", "required string")
        content_type, b64 = item["content_type"], item["base64"]
        if b64[:5].lower() == "data:":
            raise _refuse(f"{field}.base64", "must be raw base64, not a data URL")
    else:
        raise _refuse(field, "must be a data URL string or an object {content_type, base64}",
                      limit="data URL or {content_type, base64}")
    if content_type.lower() not in CONTENT_TYPES:
        raise _refuse(field, f"content type {content_type[:40]!r} is not one of {', '.join(CONTENT_TYPES)}",
                      limit=", ".join(CONTENT_TYPES))
    return content_type.lower(), b64


def parse_images(images: list) -> list[bytes]:
    """The ``images`` array -> each image's file bytes, after the count and byte limits."""
    if len(images) > MAX_IMAGES:
        raise _refuse("images", f"at most {MAX_IMAGES} images, got {len(images)}",
                      limit=f"{MAX_IMAGES} images")
    parsed = [parse_item(item, i) for i, item in enumerate(images)]
    total, out = 0, []
    for i, (_, b64) in enumerate(parsed):
        field = f"images[{i}]"
        size = _payload_size(b64, field)
        if size > MAX_IMAGE_BYTES:
            raise _refuse(field, f"image is {size} bytes; at most {MAX_IMAGE_BYTES} (4 MiB) per image",
                          limit="4 MiB")
        total += size
        if total > MAX_TOTAL_BYTES:
            raise _refuse(field, f"images total {total} bytes so far; at most {MAX_TOTAL_BYTES} (8 MiB) in all",
                          limit="8 MiB in total")
        if size == 0:
            raise _refuse(field, "image payload is empty")
        out.append(binascii.a2b_base64(b64))
    return out


def decode(data: bytes, index: int, admit: Callable[[int, int], None] | None = None) -> np.ndarray:
    """File bytes -> [H, W, 3] uint8, as the reference decodes (alpha dropped, not composited; palette and
    greyscale expanded; EXIF orientation applied, as transformers 5.24 does). Dimensions are checked from the
    header, before the pixels are decompressed; so is ``admit(width, height)``, which raises to refuse them."""
    from PIL import Image, ImageOps

    field = f"images[{index}]"
    invalid = "image payload is invalid"
    try:
        with warnings.catch_warnings():
            # our own limit is far below Pillow's bomb threshold; its warning must not leak into logs
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise _refuse(field, f"image has more than {MAX_PIXELS} pixels", limit="16 megapixels") from None
    except Exception:   # noqa: BLE001  Pillow raises many types for bad bytes; all are the client's
        raise _refuse(field, f"{invalid} (not a decodable PNG, JPEG or WebP)") from None
    with im:
        w, h = im.size
        if w < 1 or h < 1:
            raise _refuse(field, f"{invalid} (size {w}x{h})")
        if w * h > MAX_PIXELS:
            raise _refuse(field, f"image is {w}x{h} = {w * h} pixels; at most {MAX_PIXELS} (16 megapixels)",
                          limit="16 megapixels")
        if max(w, h) / min(w, h) > MAX_ASPECT:
            raise _refuse(field, f"image is {w}x{h}; the aspect ratio must be at most {MAX_ASPECT}",
                          limit=f"aspect ratio {MAX_ASPECT}")
        if admit is not None:
            admit(w, h)
        if getattr(im, "n_frames", 1) > 1:
            raise _refuse(field, "animated images are not supported", limit="one frame")
        rawmode = im.tile[0][3] if im.tile and isinstance(im.tile[0][3], str) else ""
        if im.mode not in MODES or ";16" in rawmode:
            raise _refuse(field, f"pixel format {im.mode}{' (16-bit)' if ';16' in rawmode else ''} is not "
                                 f"supported (8-bit RGB, RGBA, grey, palette)", limit="8-bit RGB, RGBA, grey, palette")
        try:
            im.load()
            # each step only where it changes something: a full-size copy each is a millisecond per megapixel
            if im.getexif().get(ORIENTATION, 1) != 1:
                im = ImageOps.exif_transpose(im)
            if im.mode != "RGB":
                im = im.convert("RGB")
            rgb = np.asarray(im, dtype=np.uint8)
        except Exception:   # noqa: BLE001  truncated or corrupt data behind a valid header
            raise _refuse(field, f"{invalid} (truncated or corrupt data)") from None
    return np.ascontiguousarray(rgb)


def load_images(images: list) -> list[np.ndarray]:
    """The validated ``images`` array -> decoded RGB arrays, request order."""
    return [decode(data, i) for i, data in enumerate(parse_images(images))]
