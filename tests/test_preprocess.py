"""Preprocessing (clefcore/preprocess.py): pixel_values and grids bit for bit against the reference processor."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from clefcore import preprocess as pp

from golden_images_data import EXPECTED, image_file

IMAGES = {img["image"]: img for fx in EXPECTED for img in fx["images"] if "grid_thw" in img}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_pixel_values_bit_exact(name):
    path = image_file(name)
    if path is None:
        pytest.skip(f"{name}: only in ../shared/golden-images")
    fx = load_file(str(path))
    meta = IMAGES[name]
    assert pp.smart_resize(*fx["decoded_rgb"].shape[:2]) == tuple(meta["resized_hw"])
    got = pp.preprocess(fx["decoded_rgb"])
    assert list(got.grid_thw) == fx["image_grid_thw"][0].tolist() == meta["grid_thw"]
    assert got.num_tokens == meta["num_tokens"]
    assert got.values.dtype == np.float32 and got.values.shape == fx["pixel_values"].shape
    assert np.array_equal(got.values.view(np.uint32), fx["pixel_values"].view(np.uint32))


@pytest.mark.parametrize("hw,want", [
    ((48, 64), (224, 320)),            # min_pixels: upscaled
    ((256, 272), (256, 256)),          # 272 / 32 = 8.5 rounds half to even
    ((40, 300), (96, 704)),
    ((1024, 1024), (1024, 1024)),
    ((5000, 5000), (4096, 4096)),      # max_pixels: floor after dividing by beta
])
def test_smart_resize(hw, want):
    assert pp.smart_resize(*hw) == want


def test_smart_resize_refuses_extreme_aspect():
    with pytest.raises(ValueError):
        pp.smart_resize(1, 201)


def test_resize_is_not_pillows_bicubic():
    # The int16 variant differs from Pillow's 22-bit BICUBIC by a level here and there (clef-images.md 4);
    # a port that called Pillow would fail test_pixel_values_bit_exact. Here: an unchanged size is a copy.
    rgb = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    assert np.array_equal(pp.resize(rgb, 64, 96), rgb)
    down = pp.resize(rgb, 32, 48)
    assert down.shape == (32, 48, 3) and down.dtype == np.uint8


def test_normalisation_levels():
    # (k - 127.5) / 127.5 in fp32: 0 -> -1, 255 -> 1, and no level is (k / 255 - 0.5) / 0.5 when they differ
    rgb = np.tile(np.arange(256, dtype=np.uint8)[None, :, None], (32, 1, 3))[:, :256]
    values = pp.patch_values(np.ascontiguousarray(np.broadcast_to(rgb, (32, 256, 3))))
    assert values.min() == -1.0 and values.max() == 1.0
    want = (np.arange(256, dtype=np.float32) - np.float32(127.5)) / np.float32(127.5)
    assert set(np.unique(values).tolist()) == set(want.tolist())


def test_a_resized_image_must_be_whole_merge_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        pp.pixels(np.zeros((48, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="multiples of 32"):
        pp.patch_values(np.zeros((32, 64, 4), np.uint8))
    assert pp.pixels(np.zeros((32, 96, 3), np.uint8)).grid_thw == (1, 2, 6)


def test_smart_resize_within_other_bounds():
    # Qwen2-VL's processor defaults: 5000 x 5000 -> beta = sqrt(25e6 / 1003520) = 4.9912, 5000 / beta / 32 = 31.3
    bounds = pp.PixelBounds(56 * 56, 28 * 28 * 1280)
    assert pp.smart_resize(5000, 5000, bounds) == (992, 992)
    assert pp.smart_resize(48, 64, bounds) == (64, 64)          # 2 x 2 blocks of 32 = 4096 pixels >= 3136
    assert pp.preprocess(np.zeros((5000, 5000, 3), np.uint8), bounds).grid_thw == (1, 62, 62)
    with pytest.raises(ValueError):
        pp.PixelBounds(100, 99)
