"""Decoded RGB -> the vision tower's input, bit for bit as the reference processor (clef-images.md §3-6).

smart_resize picks the size, torch's uint8 antialiased bicubic (int16 weights, not Pillow's 22-bit ones)
resizes, (k - 127.5) / 127.5 normalises, and the patches are laid out in merge-block order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PATCH = 16
MERGE = 2
TEMPORAL = 2
FACTOR = PATCH * MERGE
MIN_PIXELS = 65_536          # processor_config size.shortest_edge (a pixel count, despite the name)
MAX_PIXELS = 16_777_216      # size.longest_edge
# fused rescale + normalise: mean and std both 0.5 / (1/255) = 127.5 in fp32, so each level maps to one float
_LEVELS = (np.arange(256, dtype=np.float32) - np.float32(127.5)) / np.float32(127.5)


@dataclass(frozen=True)
class Pixels:
    values: np.ndarray        # [grid_h * grid_w, 3 * 2 * 16 * 16] fp32, merge-block order
    grid_thw: tuple[int, int, int]

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens (merged 2x2 patches) this image becomes."""
        return self.grid_thw[1] * self.grid_thw[2] // (MERGE * MERGE)


def smart_resize(height: int, width: int) -> tuple[int, int]:
    """(h', w'): multiples of 32 near the original, within [MIN_PIXELS, MAX_PIXELS]; Python's round (half to
    even), as the reference."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
    h = round(height / FACTOR) * FACTOR
    w = round(width / FACTOR) * FACTOR
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
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


def _resize_axis(img: np.ndarray, size_out: int, axis: int) -> np.ndarray:
    """One pass over ``axis`` of a uint8 [H, W, C] image: (2^(p-1) + sum pixel * w) >> p, clamped to uint8."""
    size_in = img.shape[axis]
    xmin, w, p = _axis_weights(size_in, size_out)
    src = np.ascontiguousarray(np.moveaxis(img, axis, 0))                     # [in, other, C] uint8, rows contiguous
    # int32 holds every sum when 255 * sum|w| fits (always, for the sizes smart_resize allows); else int64
    wide = 255 * int(np.abs(w).sum(axis=1).max()) + (1 << p) >= (1 << 31)
    acc_t = np.int64 if wide else np.int32
    w = w.astype(acc_t)
    src = src.astype(acc_t)                                                   # same-type products are much faster
    acc = np.full((size_out,) + src.shape[1:], 1 << (p - 1), dtype=acc_t)
    tmp = np.empty_like(acc)
    for k in range(w.shape[1]):                                               # one tap at a time: bounded memory
        idx = np.minimum(xmin + k, size_in - 1)                               # beyond-range taps have weight 0
        np.take(src, idx, axis=0, out=tmp)
        tmp *= w[:, k].reshape((-1,) + (1,) * (src.ndim - 1))
        acc += tmp
    np.right_shift(acc, p, out=acc)                                           # arithmetic shift, as torch
    out = np.clip(acc, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch's uint8 antialiased bicubic resize of [H, W, 3]: horizontal pass, then vertical; an axis whose size
    does not change is skipped."""
    if img.shape[1] != width:
        img = _resize_axis(img, width, 1)
    if img.shape[0] != height:
        img = _resize_axis(img, height, 0)
    return img


def patches(img: np.ndarray) -> Pixels:
    """Resized uint8 [H', W', 3] -> normalised patch rows in merge-block order (block row, block column, row in
    block, column in block); each row [channel][t][y][x], the one frame repeated for both temporal slots."""
    H, W, _ = img.shape
    gh, gw = H // PATCH, W // PATCH
    x = _LEVELS[img]                                                           # [H, W, 3] fp32
    x = x.reshape(gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH, 3)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)                                       # [bh, bw, mh, mw, C, y, x]
    x = np.broadcast_to(x[..., None, :, :], x.shape[:5] + (TEMPORAL,) + x.shape[5:])
    return Pixels(np.ascontiguousarray(x).reshape(gh * gw, 3 * TEMPORAL * PATCH * PATCH), (1, gh, gw))


def preprocess(rgb: np.ndarray) -> Pixels:
    """Decoded [H, W, 3] uint8 -> the processor's pixel_values and grid for this image."""
    h, w = smart_resize(rgb.shape[0], rgb.shape[1])
    return patches(resize(rgb, h, w))
