"""The attention kernel's work list (``attention.attention_tiles``), checked on the host (no GPU needed): every query
row of the block is in exactly one tile of its own sequence, no tile reaches key rows past the block (the K/V
cache there is not written yet), and the list is ordered longest causal range first, which the kernel's grid
relies on to start every head's longest blocks in its first wave."""

import numpy as np
import pytest

from clefcore.backends.cuda.attention import attention_tiles

RNG = np.random.default_rng()


def packed(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def check_tiles(cu, t0, t1, rows):
    tiles = attention_tiles(cu, t0, t1, rows)
    assert tiles.dtype == np.int32 and tiles.ndim == 2 and tiles.shape[1] == 4
    covered = np.zeros(t1 - t0, dtype=np.int64)
    seq_of = np.searchsorted(cu, np.arange(cu[-1]), side="right") - 1
    for s0, s1, q0, q1 in tiles.tolist():
        assert t0 <= q0 < q1 <= t1 and q1 - q0 <= rows
        k = seq_of[q0]
        assert s0 == cu[k] and seq_of[q1 - 1] == k            # one sequence per tile, named by its start
        assert s1 == min(cu[k + 1], t1)                        # keys stop at the block's end
        covered[q0 - t0:q1 - t0] += 1
    assert np.all(covered == 1), "a query row in no tile or in two"
    reach = tiles[:, 3].astype(np.int64) - tiles[:, 0]
    assert np.all(np.diff(reach) <= 0), "not longest causal range first"
    return tiles


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("lengths", [[1], [63], [65], [300], [1, 63, 65, 129], [512] * 16, [1] * 200])
def test_whole_stream(lengths, rows):
    cu = packed(lengths)
    tiles = check_tiles(cu, 0, int(cu[-1]), rows)
    assert len(tiles) == sum(-(-n // rows) for n in lengths)


@pytest.mark.parametrize("rows", [64, 128])
def test_token_blocks_of_random_packed_streams(rows):
    for _ in range(50):
        cu = packed(RNG.integers(1, 700, size=RNG.integers(1, 12)))
        T = int(cu[-1])
        block = int(RNG.integers(1, T + 1))
        for t0 in range(0, T, block):
            check_tiles(cu, t0, min(t0 + block, T), rows)


def test_empty_block_gives_an_empty_list():
    tiles = attention_tiles(packed([10]), 5, 5, 64)
    assert tiles.shape == (0, 4) and tiles.dtype == np.int32
