"""schemathesis hooks (loaded through SCHEMATHESIS_HOOKS by tests/test_server_schema.py): strategies for the
two custom string formats the OpenAPI schema gives image payloads (server/openapi.py).

JSON Schema can say that an image is a data URL or padded base64, not that its bytes decode: random base64
matching the pattern is refused with 422 ("image payload is invalid"), which would read as "valid data
rejected". So schema-valid generation draws real, small images: PNG (RGB, RGBA, grey, palette), JPEG and
WebP, sent with either MIME type spelling and `data:` in any case, as the schema allows."""

from __future__ import annotations

import base64
import io

import schemathesis
from hypothesis import strategies as st
from PIL import Image


def _encoded(mode: str, size: tuple[int, int], fmt: str) -> str:
    im = Image.new("RGB", size)
    im.putdata([(17 * x % 256, 29 * y % 256, 97) for y in range(size[1]) for x in range(size[0])])
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")


IMAGES = [("image/png", _encoded("RGB", (16, 16), "PNG")),
          ("image/png", _encoded("RGBA", (40, 24), "PNG")),
          ("image/png", _encoded("L", (24, 40), "PNG")),
          ("image/png", _encoded("P", (33, 17), "PNG")),
          ("image/jpeg", _encoded("RGB", (48, 32), "JPEG")),
          ("image/jpg", _encoded("RGB", (20, 20), "JPEG")),
          ("image/webp", _encoded("RGB", (32, 32), "WEBP"))]

schemathesis.openapi.format("image-base64", st.sampled_from([b64 for _, b64 in IMAGES]))
schemathesis.openapi.format("image-data-url", st.tuples(
    st.sampled_from(["data", "DATA", "Data"]), st.sampled_from(IMAGES), st.booleans(),
).map(lambda t: f"{t[0]}:{t[1][0].upper() if t[2] else t[1][0]};base64,{t[1][1]}"))
