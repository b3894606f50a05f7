"""The image processor's pixel bounds as the model's processor config gives them, and the server's limits on
image tokens (clefcore/preparer.py): refused from the image's size, before it is resized, naming the limit."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from clefcore.errors import CheckpointError, ImageTokensError
from clefcore.preparer import PROCESSOR_DEFAULT_PIXELS, ImageLimits, pixel_bounds, request_pixels
from clefcore.preprocess import PixelBounds

from golden_images_data import MODEL
from test_images import encode


def _png(width: int, height: int) -> bytes:
    return encode(Image.new("1", (width, height)))   # a 1-bit PNG: what a validated request's images hold


def _write(path, body) -> None:
    path.write_text(json.dumps(body))


def test_pixel_bounds_from_the_processor_config(tmp_path):
    assert pixel_bounds(tmp_path) == PixelBounds()              # no processor config: the release's bounds
    processor = tmp_path / "processor_config.json"
    _write(processor, {"image_processor": {"size": {"shortest_edge": 4096, "longest_edge": 1_048_576}}})
    assert pixel_bounds(tmp_path) == PixelBounds(4096, 1_048_576)
    # min_pixels / max_pixels replace the size's bounds, as the reference's image processor does; null does not
    _write(processor, {"image_processor": {"size": {"shortest_edge": 4096, "longest_edge": 1_048_576},
                                           "max_pixels": 262_144, "min_pixels": None}})
    assert pixel_bounds(tmp_path) == PixelBounds(4096, 262_144)
    _write(processor, {"image_processor": {}})                  # neither: the processor class's defaults
    assert pixel_bounds(tmp_path) == PixelBounds(*PROCESSOR_DEFAULT_PIXELS)
    processor.unlink()
    _write(tmp_path / "preprocessor_config.json", {"min_pixels": 3136, "max_pixels": 12_845_056})
    assert pixel_bounds(tmp_path) == PixelBounds(3136, 12_845_056)
    for bad in ({"size": {"shortest_edge": 4096}}, {"min_pixels": "4096"}, {"min_pixels": 10, "max_pixels": 5},
                {"max_pixels": 0}, {"min_pixels": True}, [65_536, 16_777_216]):
        _write(tmp_path / "preprocessor_config.json", bad)
        with pytest.raises(CheckpointError):
            pixel_bounds(tmp_path)


def test_release_bounds_match_the_golden_model():
    assert pixel_bounds(MODEL) == PixelBounds(65_536, 16_777_216)


def test_image_token_limits_per_image_and_per_request():
    small, large = _png(512, 512), _png(1024, 768)          # 256 and 768 image tokens
    request = {"images": [small, large]}
    assert [p.num_tokens for p in request_pixels(request)] == [256, 768]
    assert len(request_pixels(request, limits=ImageLimits(768, 1024))) == 2      # both limits are inclusive
    with pytest.raises(ImageTokensError) as refused:
        request_pixels(request, limits=ImageLimits(per_image=767))
    error = refused.value
    assert error.field == "images[1]" and error.limit == "767 image tokens per image"
    assert "1024x768" in error.message and "768 image tokens" in error.message
    with pytest.raises(ImageTokensError) as refused:
        request_pixels(request, limits=ImageLimits(per_request=1023))
    assert refused.value.field == "images" and refused.value.limit == "1023 image tokens per request"
    # the processor's bounds apply first: within 262,144 pixels, beta = sqrt(3), 768 x 1024 -> 416 x 576 pixels
    assert [p.num_tokens for p in request_pixels({"images": [large]}, PixelBounds(4096, 262_144),
                                                 ImageLimits(per_image=234))] == [416 * 576 // 1024] == [234]
    with pytest.raises(ValueError):
        ImageLimits(per_image=0)


def test_refused_from_the_header_before_the_pixels_are_decompressed(monkeypatch):
    # the 4000 x 4000 PNG's pixels are never decoded: Pillow's load would be the first to touch them
    from PIL import ImageFile
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or None)
    with pytest.raises(ImageTokensError) as refused:
        request_pixels({"images": [_png(4000, 4000)]}, limits=ImageLimits(per_image=1024))
    assert refused.value.field == "images[0]" and "15625 image tokens" in refused.value.message
    assert loads == []
