"""Over 200 hostile image bodies through Engine.prepare: each refused with a RequestError (a 422) or, where
still decodable, answered; nothing else escapes."""

from __future__ import annotations

import base64
import copy
import json
import zlib

import numpy as np
import pytest
from PIL import Image

import clefcore
from clefcore.errors import RequestError

from golden_images_data import MODEL, REQUESTS
from test_images import encode as _encode, png_chunks, url

BASE = {k: v for k, v in REQUESTS[0].items() if k != "images"}


def sources() -> list[bytes]:
    """The distinct fixture images' file bytes (PNG, JPEG, WebP, RGBA, palette, grey)."""
    seen = {}
    for body in REQUESTS:
        for item in body["images"]:
            b64 = item["base64"] if isinstance(item, dict) else item.split(",", 1)[1]
            seen.setdefault(b64, base64.b64decode(b64))
    return list(seen.values())


def hostile_bodies() -> list[tuple[str, object]]:
    rng = np.random.default_rng(21)
    out = []
    srcs = sources()
    for s, data in enumerate(srcs):
        # truncated files (the last cut, one byte short, may still hold every pixel: a PNG's IEND is not needed)
        for cut in sorted(set(np.linspace(0, len(data) - 1, 16).astype(int).tolist())):
            out.append((f"src{s}-cut{cut}" + ("-last" if cut == len(data) - 1 else ""), [url(data[:cut])]))
        for k in range(12):                                                               # damaged bytes
            buf = bytearray(data)
            for pos in rng.integers(0, min(len(buf), 64 if k < 6 else len(buf)), size=1 + k % 4):
                buf[pos] ^= int(rng.integers(1, 256))
            out.append((f"src{s}-flip{k}", [url(bytes(buf))]))
        out.append((f"src{s}-magic", [url(b"\0\0\0\0" + data[4:])]))
        out.append((f"src{s}-doubled", [url(data + data)]))
    for w, h in ((5000, 5000), (4001, 4000), (1, 100000), (65535, 65535), (2**31 - 1, 1), (0, 10), (10, 0)):
        out.append((f"header-{w}x{h}", [url(png_chunks(w, h))]))
    for depth, color in ((16, 2), (16, 0), (1, 3), (8, 6), (8, 4), (4, 0), (8, 9)):
        out.append((f"png-depth{depth}-color{color}", [url(png_chunks(64, 64, depth, color))]))
    out.append(("bomb-36MP", [url(_encode(Image.new("L", (6000, 6000)), optimize=True))]))
    # 5000 x 4000 rows of zeros behind a 27 kB IDAT: refused from the header, before inflating 60 MB
    out.append(("bomb-zlib", [url(png_chunks(5000, 4000, idat=zlib.compress(b"\0" * 60_004_000, 9)))]))
    good = REQUESTS[0]["images"][0]
    for name, images in (
            ("five", [good] * 5), ("path", ["/etc/passwd"]), ("path-dots", ["../../model/config.json"]),
            ("http", ["http://127.0.0.1:8080/healthz"]), ("https", ["https://example.com/x.png"]),
            ("file-url", ["file:///etc/shadow"]), ("ftp", ["ftp://x/y.png"]), ("bare-b64", [good.split(",", 1)[1]]),
            ("gif-mime", [good.replace("image/png", "image/gif")]), ("svg", ["data:image/svg+xml;base64,PHN2Zz4="]),
            ("no-base64", [good.replace(";base64", "")]), ("spaces", [good[:60] + " " + good[60:]]),
            ("newlines", [good[:60] + "\n" + good[60:]]), ("urlsafe", [good.replace("+", "-").replace("/", "_")]),
            ("unpadded", ["data:image/png;base64,iVBORw0KGgo"]), ("empty", ["data:image/png;base64,"]),
            ("null-item", [None]), ("number", [1]), ("bool", [True]), ("list-item", [[good]]),
            ("object-missing", [{"content_type": "image/png"}]), ("object-extra", [{"content_type": "image/png",
                                                                                    "base64": "", "x": 1}]),
            ("object-url", [{"content_type": "image/png", "base64": good}]),
            ("object-bad-type", [{"content_type": "text/html", "base64": good.split(",", 1)[1]}]),
            ("object-nonstring", [{"content_type": "image/png", "base64": 5}]),
            ("string", good), ("object", {"content_type": "image/png", "base64": "x"}), ("number-field", 3),
            ("too-big", ["data:image/png;base64," + "A" * (4 * 1024 * 1024 // 3 * 4 + 8)]),
            ("too-big-total", ["data:image/png;base64," + "A" * (3 * 1024 * 1024 // 3 * 4)] * 3),
            ("gif", [url(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;")]), ("bmp", [url(b"BM" + b"\0" * 60)]),
            ("tiff", [url(b"II*\0" + b"\0" * 60, "image/jpeg")]), ("pdf", [url(b"%PDF-1.4\n" + b"\0" * 40)]),
            ("zip", [url(b"PK\x03\x04" + b"\0" * 60)]), ("html", [url(b"<html></html>")]),
            ("aspect", [url(_encode(Image.new("RGB", (300, 1))))]),
            ("cmyk", [url(_encode(Image.new("CMYK", (32, 32)), "JPEG"), "image/jpeg")]),
            ("i16", [url(_encode(Image.new("I;16", (32, 32))))]),
            ("animated", [url(_encode(Image.new("RGB", (32, 32)), save_all=True,
                                      append_images=[Image.new("RGB", (32, 32), (1, 2, 3))]))]),
            ("animated-webp", [url(_encode(Image.new("RGB", (32, 32)), "WEBP", save_all=True, duration=100,
                                           append_images=[Image.new("RGB", (32, 32), (200, 2, 3))]), "image/webp")]),
    ):
        out.append((name, images))
    return out


BODIES = hostile_bodies()


@pytest.fixture(scope="module")
def engine():
    return clefcore.load(MODEL, device="cpu", validation="cloudflare")


def test_suite_size():
    assert len(BODIES) >= 200


@pytest.mark.parametrize("name,images", BODIES, ids=[n for n, _ in BODIES])
def test_hostile_body(engine, name, images):
    body = copy.deepcopy(BASE)
    body["images"] = images
    parsed = json.loads(json.dumps(body))      # what the server hands the engine
    try:
        prepared = engine.prepare(parsed)
    except RequestError as e:
        assert e.field.startswith("images") and e.message.startswith(e.field), (e.field, e.message)
        return
    # accepted: only damage that leaves a decodable image of the allowed kinds may get here
    assert name.startswith("src") and ("flip" in name or "doubled" in name or name.endswith("-last")), name
    assert prepared.record.images and prepared.record.positions is not None
