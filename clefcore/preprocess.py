"""Decoded RGB -> the vision tower's input, bit for bit as the reference processor (clef-images.md §3-6).

smart_resize picks the size, torch's uint8 antialiased bicubic (int16 weights, not Pillow's 22-bit ones)
resizes, (k - 127.5) / 127.5 normalises, and the patches are laid out in merge-block order.

A request keeps its images resized but still uint8 (``Pixels.image``): the backend makes the normalised patch rows
where the tower runs (``ops.patch_rows``), so a GPU receives 3 bytes a pixel instead of a 25 MB fp32 array per
megapixel built on the host. ``Pixels.values`` builds those rows here, for checks and ``--debug``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PATCH = 16
MERGE = 2
TEMPORAL = 2
FACTOR = PATCH * MERGE
MIN_PIXELS = 65_536          # the release's processor_config size.shortest_edge (a pixel count, despite the name)
MAX_PIXELS = 16_777_216      # its size.longest_edge
# fused rescale + normalise: mean and std both 0.5 / (1/255) = 127.5 in fp32, so each level maps to one float
_LEVELS = (np.arange(256, dtype=np.float32) - np.float32(127.5)) / np.float32(127.5)


@dataclass(frozen=True)
class Pixels:
    image: np.ndarray         # [16 grid_h, 16 grid_w, 3] uint8: resized, C-contiguous
    grid_thw: tuple[int, int, int]

    @property
    def values(self) -> np.ndarray:
        """The processor's pixel_values: [grid_h * grid_w, 3 * 2 * 16 * 16] fp32, merge-block order."""
        return patch_values(self.image)

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens (merged 2x2 patches) this image becomes."""
        return self.grid_thw[1] * self.grid_thw[2] // (MERGE * MERGE)


@dataclass(frozen=True)
class PixelBounds:
    """The processor's bounds on a resized image's pixels (its ``size``: ``shortest_edge`` is the least pixel
    count, ``longest_edge`` the most); the release's by default."""
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"pixel bounds must satisfy 0 < min <= max, got {self.min_pixels}, {self.max_pixels}")


def smart_resize(height: int, width: int, bounds: PixelBounds = PixelBounds()) -> tuple[int, int]:
    """(h', w'): multiples of 32 near the original, within the bounds' [min_pixels, max_pixels]; Python's round
    (half to even), as the reference."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
    h = round(height / FACTOR) * FACTOR
    w = round(width / FACTOR) * FACTOR
    if h * w > bounds.max_pixels:
        beta = math.sqrt(height * width / bounds.max_pixels)
        h = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h * w < bounds.min_pixels:
        beta = math.sqrt(bounds.min_pixels / (height * width))
        h = math.ceil(height * beta / FACTOR) * FACTOR
        w = math.ceil(width * beta / FACTOR) * FACTOR
    return h, w


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with a = -0.5 (torch's aa bicubic filter)."""
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                    np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))


def _axis_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first source index [out], int16 weights [out, taps], precision) of one axis, as torch's uint8 aa
    kernel computes them (weights in doubles, normalised, then scaled to int16 at the largest safe precision)."""
    scale = size_in / size_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(size_out) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)          # int() truncates; both >= 0 here
    xmax = np.minimum((center + support + 0.5).astype(np.int64), size_in)
    taps = int((xmax - xmin).max())
    j = np.arange(taps)[None, :]
    w = _cubic((j + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j < (xmax - xmin)[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    w_max = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * float(1 << precision)
    w_int = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int64)
    return xmin, w_int, precision


STRIP = 64    # rows per strip: the int32 temporaries stay small and are reused (fresh large arrays page-fault)


def _resize_axis(img: np.ndarray, size_out: int, axis: int) -> np.ndarray:
    """One pass over ``axis`` (0 or 1) of a uint8 [H, W, C] image: (2^(p-1) + sum pixel * w) >> p, clamped to
    uint8. Runs in strips of rows, one tap at a time, in int32 (wide enough: see below)."""
    size_in = img.shape[axis]
    xmin, w, p = _axis_weights(size_in, size_out)
    # int32 holds every sum when 255 * sum|w| fits (always, for the sizes smart_resize allows); else int64
    acc_t = np.int64 if 255 * int(np.abs(w).sum(axis=1).max()) + (1 << p) >= (1 << 31) else np.int32
    w = w.astype(acc_t)
    idx = np.minimum(xmin[:, None] + np.arange(w.shape[1])[None, :], size_in - 1)   # beyond-range taps weigh 0
    shape = list(img.shape)
    shape[axis] = size_out
    out = np.empty(shape, dtype=np.uint8)
    rows = size_out if axis == 0 else img.shape[0]          # strips over output rows (axis 0) or input rows (1)
    strip = (min(STRIP, rows),) + tuple(shape[1:])
    acc, tmp, gathered = np.empty(strip, acc_t), np.empty(strip, acc_t), np.empty(strip, np.uint8)
    for r0 in range(0, rows, STRIP):
        r1 = min(r0 + STRIP, rows)
        n = r1 - r0
        a, t, g = acc[:n], tmp[:n], gathered[:n]
        a.fill(1 << (p - 1))
        for k in range(w.shape[1]):
            if axis == 0:
                np.take(img, idx[r0:r1, k], axis=0, out=g)
                np.multiply(g, w[r0:r1, k, None, None], out=t)
            else:
                np.take(img[r0:r1], idx[:, k], axis=1, out=g)
                np.multiply(g, w[None, :, k, None], out=t)
            a += t
        np.right_shift(a, p, out=a)                          # arithmetic shift, as torch
        np.clip(a, 0, 255, out=a)
        out[r0:r1] = a
    return out


def resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch's uint8 antialiased bicubic resize of [H, W, 3]: horizontal pass, then vertical; an axis whose size
    does not change is skipped."""
    if img.shape[1] != width:
        img = _resize_axis(img, width, 1)
    if img.shape[0] != height:
        img = _resize_axis(img, height, 0)
    return img


def patch_grid(shape) -> tuple[int, int]:
    """(patch rows, patch columns) of a resized image of ``shape`` [H', W', 3]; ValueError unless both sides are
    multiples of 32 (smart_resize makes them so)."""
    if len(shape) != 3 or shape[2] != 3 or shape[0] % FACTOR or shape[1] % FACTOR:
        raise ValueError(f"image of shape {tuple(shape)}: expected [H, W, 3] with H and W multiples of {FACTOR}")
    return shape[0] // PATCH, shape[1] // PATCH


def patch_values(img: np.ndarray) -> np.ndarray:
    """Resized uint8 [H', W', 3] -> normalised patch rows in merge-block order (block row, block column, row in
    block, column in block); each row [channel][t][y][x], the one frame repeated for both temporal slots.
    numpy twin of cuda/vision.cu::patch_rows."""
    gh, gw = patch_grid(img.shape)
    n, m = gh * gw, MERGE
    # the layout is done on the uint8 pixels (4x smaller), then each level looked up once into the output
    u8 = img.reshape(gh // m, m, PATCH, gw // m, m, PATCH, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    u8 = np.ascontiguousarray(u8).reshape(n, 3, PATCH * PATCH)                    # [bh, bw, mh, mw, C, y, x]
    values = np.empty((n, 3, TEMPORAL, PATCH * PATCH), dtype=np.float32)
    np.take(_LEVELS, u8, out=values[:, :, 0], mode="clip")                       # uint8 indices: always in range
    values[:, :, 1:] = values[:, :, :1]                                           # the frame, repeated
    return values.reshape(n, 3 * TEMPORAL * PATCH * PATCH)


def pixels(img: np.ndarray) -> Pixels:
    """A resized uint8 [H', W', 3] image as the tower's input (its grid: one frame of 16 x 16 patches)."""
    img = np.ascontiguousarray(img, dtype=np.uint8)
    return Pixels(img, (1,) + patch_grid(img.shape))


def preprocess(rgb: np.ndarray, bounds: PixelBounds = PixelBounds()) -> Pixels:
    """Decoded [H, W, 3] uint8 -> this image resized within ``bounds``, with its grid (``.values``: the
    processor's pixel_values)."""
    h, w = smart_resize(rgb.shape[0], rgb.shape[1], bounds)
    return pixels(resize(rgb, h, w))
