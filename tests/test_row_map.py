"""device.row_map on numpy views of the model's shapes: every promised row is where it says; what it cannot
walk comes back None."""

import numpy as np
import pytest

from clefcore.backends.cuda.device import row_map


def rows_at(x, m):
    """The R rows of D that row_map's (rs, heads, hs) points at, read from x's first element on, as the kernel
    reads them."""
    rs, heads, hs = m
    D, it = x.shape[-1], x.itemsize
    R = int(np.prod(x.shape[:-1], dtype=np.int64))
    v = np.lib.stride_tricks.as_strided(x, shape=(R // heads, heads, D), strides=(rs * it, hs * it, it))
    return v.reshape(R, D)


def owner(n):
    return np.arange(n, dtype=np.float32)


@pytest.mark.parametrize("T", [1, 5])
def test_views_the_model_passes(T):
    H, D = 3, 4
    cases = {
        "contiguous": owner(T * 7).reshape(T, 7),
        "column slice": owner(T * 9).reshape(T, 9)[:, 2:5],
        "q of [T, H, 2, D]": owner(T * H * 2 * D).reshape(T, H, 2, D)[:, :, 0],
        "conv q columns per head": owner(T * 30).reshape(T, 30)[:, 2:2 + H * D].reshape(T, H, D),
        "fused qkv, q per head": owner(T * 40).reshape(T, 40)[:, :H * 2 * D].reshape(T, H, 2, D)[:, :, 0],
        "one column": owner(T * 3).reshape(T, 3)[:, 1:2],
    }
    for name, x in cases.items():
        m = row_map(x.shape, x.strides, x.itemsize)
        assert m is not None, name
        np.testing.assert_array_equal(rows_at(x, m), x.reshape(-1, x.shape[-1]), err_msg=name)
    # the per-head views of a wider row need the second level (T > 1); a single token is uniform
    m = row_map(cases["conv q columns per head"].shape, cases["conv q columns per head"].strides, 4)
    assert (m[1] == H) == (T > 1)


def test_views_it_cannot_walk():
    x = owner(20).reshape(4, 5)
    gap = np.lib.stride_tricks.as_strided(owner(400), shape=(2, 3, 2, 4), strides=(800, 160, 64, 4))
    for name, v in {"transposed": x.T, "reversed rows": x[::-1], "4-d with a gap": gap,
                    "0-d": np.float32(1.0).reshape(())}.items():
        assert row_map(v.shape, v.strides, 4) is None, name
