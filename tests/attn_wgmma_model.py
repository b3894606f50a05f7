"""A numpy model of cuda/attention_wgmma.cu (the attn_wgmma kernel switch), step by step as the kernel runs it:
the host's work list (128 query rows a block), the shared-memory images that wa_load's cp.async copies write (4
panels of 64 columns, rows of 128 bytes in the 128-byte swizzle), the wgmma operands read back from them through
the kernel's descriptors (K-major for Q and K, MN-major with the panel stride as leading offset for V), the two
warpgroups of 64 rows walking every key tile up to the block's last query, masking only the tiles that reach
past a warpgroup's first row, the online softmax in fp32 with exp2 and P rounded to fp16, O rescaled before each
P V, and only rows below q1 written.

The descriptor reads follow PTX's canonical layouts (in CUTLASS's uint128_t units: K-major
Swizzle<3,4,3> o ((8,m),(8,2)):((8,SBO),(1,8)), MN-major Swizzle<3,4,3> o ((8,n),(8,k)):((1,LBO),(8,SBO))); the
swizzle is applied to the byte address (bits 4-6 ^= bits 7-9), as the hardware does. The constants below are
the kernel's (WA_BM, WA_BC, the panel strides, the 32-byte and 2048-byte k-steps)."""

from __future__ import annotations

import numpy as np

from clefcore.backends.cuda.attention import attention_tiles

D, NP, BM, BC = 256, 4, 128, 64       # head dim, 64-column panels, query rows per block, keys per tile
ROW = 128                              # bytes per swizzled row (64 halves)
SBO = 1024                             # bytes between 8-row atoms (both descriptors)
LOG2E = np.float32(1.4426950408889634)


def swizzle(addr):
    """The 128-byte swizzle on shared-memory byte addresses (atoms 1024-byte aligned)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def store(rows: np.ndarray, R: int) -> np.ndarray:
    """wa_load: rows [n <= R, 256] (fp16) -> the image of R rows in 4 panels (uint16 per half, index = byte / 2);
    rows n.. zero-filled. Chunk c (8 halves) of row r of panel p lands at p R 128 + r 128 + ((c ^ (r % 8)) << 4)."""
    full = np.zeros((R, D), np.uint16)
    full[:rows.shape[0]] = rows.astype(np.float16).view(np.uint16)
    img = np.zeros(NP * R * ROW // 2, np.uint16)
    r = np.arange(R)[:, None, None, None]
    p = np.arange(NP)[None, :, None, None]
    c = np.arange(8)[None, None, :, None]
    e = np.arange(8)[None, None, None, :]
    dst = (p * (R * ROW) + r * ROW + ((c ^ (r & 7)) << 4)) // 2 + e
    img[dst] = full[r, p * 64 + c * 8 + e]
    return img


def halves(img, addr):
    return img[swizzle(addr) // 2].view(np.float16).astype(np.float32)


def read_k_major(img: np.ndarray, start: int, rows: int) -> np.ndarray:
    """A K-major operand (rows x 16) at descriptor start address ``start``: element (i, k) at byte
    start + (i % 8) 128 + (i // 8) SBO + 2 k, swizzled."""
    i = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    return halves(img, start + (i % 8) * ROW + (i // 8) * SBO + 2 * k)


def read_mn_major(img: np.ndarray, start: int, lbo: int, n: int) -> np.ndarray:
    """An MN-major B operand (16 k x n) at ``start`` with leading offset ``lbo``: element (k, j) at byte
    start + 2 (j % 64) + (j // 64) lbo + (k % 8) 128 + (k // 8) SBO, swizzled."""
    k = np.arange(16)[:, None]
    j = np.arange(n)[None, :]
    return halves(img, start + 2 * (j % 64) + (j // 64) * lbo + (k % 8) * ROW + (k // 8) * SBO)


def attention(q, k, v, cu_seqlens, scale, q_offset=0):
    """What attn_wgmma_fwd_d256 computes, as cpu.attention's arguments: q [n, Hq, 256] (rounded to fp16 as the
    host does), k/v [>= q_offset + n, Hkv, 256] (the fp16 cache) -> fp32 [n, Hq, 256]; rows of k/v at or past
    the block's end are never read (the test fills them with NaN)."""
    n, hq, _ = q.shape
    hkv = k.shape[1]
    t0, t1 = int(q_offset), int(q_offset) + n
    scale2 = np.float32(np.float32(scale) * LOG2E)
    out = np.full((n, hq, D), np.nan, np.float32)
    for s0, s1, q0, q1 in attention_tiles(np.asarray(cu_seqlens), t0, t1, BM).tolist():
        nt = (q1 - s0 + BC - 1) // BC
        for h in range(hq):
            kh = h // (hq // hkv)
            qimg = store(q[q0 - t0:q1 - t0, h], BM)
            kimgs = [store(k[s0 + j * BC:min(s0 + (j + 1) * BC, s1), kh], BC) for j in range(nt)]
            vimgs = [store(v[s0 + j * BC:min(s0 + (j + 1) * BC, s1), kh], BC) for j in range(nt)]
            for wg in range(2):
                w0 = q0 + 64 * wg
                rows = w0 + np.arange(64)
                o = np.zeros((64, D), np.float32)
                m = np.full(64, -np.inf, np.float32)
                l = np.zeros(64, np.float32)
                for j in range(nt):
                    j0 = s0 + j * BC
                    s = np.zeros((64, BC), np.float32)
                    for p in range(NP):
                        for ks in range(4):
                            a = read_k_major(qimg, wg * 64 * ROW + p * BM * ROW + ks * 32, 64)
                            b = read_k_major(kimgs[j], p * BC * ROW + ks * 32, BC)
                            s += (a.astype(np.float64) @ b.T.astype(np.float64)).astype(np.float32)
                    s *= scale2
                    if j0 + BC - 1 > w0:
                        s[j0 + np.arange(BC)[None, :] > rows[:, None]] = -np.inf
                    mx = np.maximum(m, s.max(axis=1))
                    muse = np.where(mx == -np.inf, np.float32(0), mx)
                    alpha = np.exp2(m - muse).astype(np.float32)
                    m = mx
                    pr = np.exp2(s - muse[:, None]).astype(np.float32)
                    l = l * alpha + pr.sum(axis=1, dtype=np.float32)
                    p16 = pr.astype(np.float16).astype(np.float32)
                    o *= alpha[:, None]
                    for kk in range(4):
                        bt = read_mn_major(vimgs[j], kk * 2048, BC * ROW, D)
                        o += (p16[:, 16 * kk:16 * kk + 16].astype(np.float64) @ bt.astype(np.float64)).astype(
                            np.float32)
                live = rows < q1
                inv = np.where(l > 0, 1 / np.maximum(l, np.float32(1e-30)), 0).astype(np.float32)
                out[rows[live] - t0, h] = o[live] * inv[live, None]
    return out
