"""The images field on the wire (clefcore/images.py): forms, limits, bounded decoding, and the reference's RGB."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from clefcore import images
from clefcore.errors import RequestError

from golden_images_data import EXPECTED, REQUESTS, image_file

PNG_URL = REQUESTS[0]["images"][0]              # shapes_64x48 as a data URL
PNG_B64 = PNG_URL.split(",", 1)[1]


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def refused(items) -> RequestError:
    with pytest.raises(RequestError) as info:
        images.load_images(items)
    return info.value


def png_chunks(width: int, height: int, depth: int = 8, color: int = 2, idat: bytes = b"") -> bytes:
    """A PNG signature, an IHDR claiming width x height (depth, color type), then an IDAT: by default one too
    short to hold the rows."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat or zlib.compress(b"\0" * 256))
            + chunk(b"IEND", b""))


# --- the reference's RGB --------------------------------------------------------------------------------

CASES = [(fx["index"], i, img) for fx in EXPECTED for i, img in enumerate(fx["images"])]


@pytest.mark.parametrize("index,item,meta", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]['image']}" for c in CASES])
def test_decoded_rgb_matches_the_reference(index, item, meta):
    path = image_file(meta["image"])
    if path is None:
        pytest.skip(f"{meta['image']}: only in ../shared/golden-images")
    want = load_file(str(path))["decoded_rgb"]
    got = images.load_images(REQUESTS[index]["images"])[item]
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)


def test_alpha_is_dropped_not_composited():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 255, 0))       # fully transparent magenta stays magenta
    got = images.load_images([url(encode(rgba))])[0]
    assert got.shape == (8, 8, 3) and (got == [255, 0, 255]).all()


def test_forms_and_case():
    data = base64.b64decode(PNG_B64)
    want = images.load_images([PNG_URL])[0]
    for item in (PNG_URL.replace("data:", "DATA:"), PNG_URL.replace("data:", "DaTa:"),
                 {"content_type": "image/png", "base64": PNG_B64}, url(data, "image/PNG"),
                 url(data, "image/jpeg")):             # the MIME type is checked, the bytes are sniffed
        assert np.array_equal(images.load_images([item])[0], want)


# --- refusals: each names the item and the rule ---------------------------------------------------------

@pytest.mark.parametrize("item,field,words", [
    ("https://example.com/a.png", "images[0]", "URL"),
    ("http://169.254.169.254/latest", "images[0]", "URL"),
    ("file:///etc/passwd", "images[0]", "URL"),
    ("/etc/passwd", "images[0]", "not a data URL"),
    (PNG_B64, "images[0]", "not a data URL"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "images[0]", "content type"),
    ("data:text/plain;base64,aGVsbG8=", "images[0]", "content type"),
    ("data:image/png,rawbytes", "images[0]", "data URL"),
    ("data:image/png;base64,iVBO RK==", "images[0]", "base64"),
    ("data:image/png;base64,iVBORw0", "images[0]", "base64"),
    ("data:image/png;base64,", "images[0]", "empty"),
    ("data:image/png;base64,AAAAAAAA", "images[0]", "invalid"),
    (None, "images[0]", "data URL"),
    (7, "images[0]", "data URL"),
    ([PNG_URL], "images[0]", "data URL"),
    ({"base64": PNG_B64}, "images[0].content_type", "required"),
    ({"content_type": "image/png"}, "images[0].base64", "required"),
    ({"content_type": "image/png", "base64": PNG_B64, "url": "x"}, "images[0].url", "unknown field"),
    ({"content_type": "image/bmp", "base64": PNG_B64}, "images[0]", "content type"),
    ({"content_type": "image/png", "base64": PNG_URL}, "images[0].base64", "raw base64"),
])
def test_bad_items_are_refused(item, field, words):
    error = refused([PNG_URL, item][1:])
    assert error.field == field and words in error.message and error.message.startswith(field)


@pytest.mark.parametrize("items,field,limit", [
    ([PNG_URL, PNG_URL, "https://x/y.png"], "images[2]", "data URL or {content_type, base64}"),   # its index
    ([PNG_URL] * 5, "images", "4 images"),
    # byte limits, checked before decoding: just over 4 MiB once decoded; three of 3 MiB
    (["data:image/png;base64," + "A" * (4 * (images.MAX_IMAGE_BYTES // 3 + 1))], "images[0]", "4 MiB"),
    (["data:image/png;base64," + "A" * (4 * (3 * 1024 * 1024 // 3))] * 3, "images[2]", "8 MiB in total"),
])
def test_the_item_and_the_limit_are_named(items, field, limit):
    error = refused(items)
    assert error.field == field and error.limit == limit
    assert limit != "4 images" or "got 5" in error.message


@pytest.mark.parametrize("size", [(4001, 4000), (16_000_001, 1), (60000, 60000), (2**31 - 1, 2**31 - 1)])
def test_too_many_pixels_refused_from_the_header(size):
    error = refused([url(png_chunks(*size))])
    assert error.field == "images[0]" and error.limit in ("16 megapixels", "aspect ratio 200")


def test_sixteen_megapixels_exactly_is_accepted_by_the_size_check():
    # 4000 x 4000 = 16.00 MP passes the header check; the bogus IDAT then fails as invalid data, not as size
    error = refused([url(png_chunks(4000, 4000))])
    assert "invalid" in error.message and error.limit is None


def test_compression_bomb_is_refused_without_decoding():
    bomb = encode(Image.new("L", (5000, 5000)), optimize=True)   # 25 MP of zeros in a few kB
    assert len(bomb) < 100_000
    error = refused([url(bomb)])
    assert error.limit == "16 megapixels"


@pytest.mark.parametrize("make,words", [
    (lambda: base64.b64decode(PNG_B64)[:200], "invalid"),                                  # truncated
    (lambda: b"GIF89a" + base64.b64decode(PNG_B64)[6:], "invalid"),                         # wrong magic
    (lambda: encode(Image.new("RGB", (4, 4)), "GIF"), "invalid"),                           # not png/jpeg/webp
    (lambda: encode(Image.new("RGB", (201, 1))), "aspect ratio"),
    (lambda: encode(Image.new("I;16", (8, 8))), "pixel format"),
    (lambda: encode(Image.new("CMYK", (8, 8)), "JPEG"), "pixel format"),
    (lambda: encode(Image.new("RGB", (8, 8)), "PNG", save_all=True,
                    append_images=[Image.new("RGB", (8, 8), (9, 9, 9))]), "animated"),
])
def test_undecodable_or_unsupported_images(make, words):
    error = refused([url(make())])
    assert error.field == "images[0]" and words in error.message


def test_exif_orientation_is_applied():
    # transformers 5.24 (the fixtures' version) applies the EXIF orientation; 6 = rotate 90 degrees clockwise
    im = Image.new("RGB", (40, 20), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 10, 10))                 # red square top-left
    exif = Image.Exif()
    exif[0x0112] = 6
    got = images.load_images([url(encode(im, "JPEG", exif=exif, quality=95), "image/jpeg")])[0]
    assert got.shape == (40, 20, 3)                        # rotated: height 40, width 20
    assert got[2, 17, 0] > 200 and got[2, 17, 2] < 60      # the red square is now top-right
