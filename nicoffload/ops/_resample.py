"""Antialiased bilinear resampling with Pillow's arithmetic, in numba, over any output window.

The filter and its coefficients are Pillow's `ImagingResample` for 8-bit images (triangle filter
widened by the downscale factor, weights computed in double in Pillow's order, rounded to 22-bit
fixed point, a uint8 rounding after each pass). The passes run in the other order, vertical
first, which lets both inner loops be vectorized; results stay within one level of
`Image.resize(..., BILINEAR)`. Computing any window of the output is what lets the fused kernels
resample only the cropped pixels; normalize's table can be applied on the way out.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np

PRECISION_BITS = 22  # Pillow's: 32 - 8 (pixel) - 2 (headroom)
_HALF = 1 << (PRECISION_BITS - 1)
_JIT = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def _coeffs(in_size, out_size, antialias):
    # Pillow's precompute_coeffs + normalize_coeffs_8bpc, same double arithmetic in the same order.
    scale = in_size / out_size
    filterscale = scale if (scale > 1.0 and antialias) else 1.0
    support = 1.0 * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    bounds = np.zeros((out_size, 2), np.int32)
    weights = np.zeros((out_size, ksize), np.int32)
    tmp = np.empty(ksize, np.float64)
    ss = 1.0 / filterscale
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ww = 0.0
        for x in range(xmax):
            t = abs((x + xmin - center + 0.5) * ss)
            w = 1.0 - t if t < 1.0 else 0.0
            tmp[x] = w
            ww += w
        for x in range(xmax):
            k = tmp[x] / ww if ww != 0.0 else tmp[x]
            weights[xx, x] = int(k * (1 << PRECISION_BITS) + (0.5 if k >= 0 else -0.5))
        bounds[xx, 0] = xmin
        bounds[xx, 1] = xmax
    return bounds, weights


@lru_cache(maxsize=4096)
def coeffs(in_size: int, out_size: int, antialias: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Resampling table for one axis: bounds[o] = (first tap, tap count), weights[o, tap] int32.

    Cached: shorter-side resizes see many sizes, but the same ones over and over.
    """
    return _coeffs(in_size, out_size, antialias)


@numba.njit(**_JIT)
def _pad(bounds, weights, in_size):
    taps = bounds[:, 1].max()
    start = np.empty(bounds.shape[0], np.int32)
    padded = np.zeros((bounds.shape[0], taps), np.int32)
    for o in range(bounds.shape[0]):
        start[o] = min(bounds[o, 0], in_size - taps)
        shift = bounds[o, 0] - start[o]
        padded[o, shift : shift + bounds[o, 1]] = weights[o, : bounds[o, 1]]
    return start, padded


@lru_cache(maxsize=4096)
def padded_coeffs(in_size: int, out_size: int, antialias: bool = True):
    """The same table with one tap count for every output (zero weights fill in, the first tap
    moved left where needed): (start[o], weights[o, tap]), so no inner loop has a ragged end."""
    bounds, weights = coeffs(in_size, out_size, antialias)
    return _pad(bounds, weights, in_size)


# Lanes of the horizontal pass: a block of LANES // C output rows x C channels. 144 was the
# fastest of 24..192 (longer blocks spread each column's setup over more rows).
LANES = 144


@numba.njit(**_JIT)
def _clip8(v):
    v >>= PRECISION_BITS
    return 0 if v < 0 else (255 if v > 255 else v)


@numba.njit(**_JIT)
def _vrow(src, yb, yw, oy, sx0, n, acc):
    """acc[i] = the vertical pass of output row oy over src's flat row elements sx0:sx0+n,
    before rounding. Four source rows per sweep over acc (then two, then one): fewer loads and
    stores of acc per tap (large shrinks have 9-11 taps)."""
    acc[:] = _HALF
    taps_y, y0 = yb[oy, 1], yb[oy, 0]
    k = 0
    while k + 4 <= taps_y:
        w0, w1, w2, w3 = yw[oy, k], yw[oy, k + 1], yw[oy, k + 2], yw[oy, k + 3]
        r0 = src[y0 + k].reshape(-1)[sx0 : sx0 + n]
        r1 = src[y0 + k + 1].reshape(-1)[sx0 : sx0 + n]
        r2 = src[y0 + k + 2].reshape(-1)[sx0 : sx0 + n]
        r3 = src[y0 + k + 3].reshape(-1)[sx0 : sx0 + n]
        for i in range(n):
            acc[i] += (
                np.int32(r0[i]) * w0
                + np.int32(r1[i]) * w1
                + (np.int32(r2[i]) * w2 + np.int32(r3[i]) * w3)
            )
        k += 4
    if k + 2 <= taps_y:
        w0, w1 = yw[oy, k], yw[oy, k + 1]
        r0 = src[y0 + k].reshape(-1)[sx0 : sx0 + n]
        r1 = src[y0 + k + 1].reshape(-1)[sx0 : sx0 + n]
        for i in range(n):
            acc[i] += np.int32(r0[i]) * w0 + np.int32(r1[i]) * w1
        k += 2
    if k < taps_y:
        w0 = yw[oy, k]
        r0 = src[y0 + k].reshape(-1)[sx0 : sx0 + n]
        for i in range(n):
            acc[i] += np.int32(r0[i]) * w0


@numba.njit(**_JIT)
def resample(src, xs, xw, yb, yw, oy0, oy1, ox0, ox1, lut, dst, dy, dx, mode):
    """Output rows oy0:oy1, columns ox0:ox1 of src resampled, written at (dy, dx) into dst.

    mode 0: dst is uint8 HWC; 1: dst[c, y, x] = lut[c, v]; 2: dst[y, x, c] = lut[c, v].
    Per block of output rows: the vertical pass over just the source columns the window needs
    (vectorized along the row), stored transposed so that one source column's rows x channels
    are contiguous; then the horizontal pass with those as vector lanes, its results kept per
    column of the block; then the block is written out a row at a time (contiguous stores; a
    column at a time cost twice as much). (Pillow goes the other way round, horizontal first,
    whose inner loop cannot be vectorized; both passes round to uint8, so the two orders differ
    by at most one level, 0.1-0.2 levels on average.)
    """
    c = src.shape[2]
    rows_per_block = max(LANES // c, 1)
    lanes = max(rows_per_block * c, LANES)
    taps = xw.shape[1]
    sx0 = xs[ox0]
    ncol = xs[ox1 - 1] + taps - sx0
    nx = ox1 - ox0
    n = ncol * c
    acc = np.empty(n, np.int32)
    line = np.empty(n, np.uint8)
    block = np.zeros((ncol, lanes), np.uint8)
    hacc = np.empty(lanes, np.int32)
    hblock = np.empty((nx, lanes), np.uint8)
    for b0 in range(oy0, oy1, rows_per_block):
        rows = min(rows_per_block, oy1 - b0)
        for r in range(rows):  # vertical pass, one output row at a time
            _vrow(src, yb, yw, b0 + r, sx0 * c, n, acc)
            for i in range(n):
                line[i] = _clip8(acc[i])
            if c == 3:
                for j in range(ncol):
                    block[j, r * 3] = line[j * 3]
                    block[j, r * 3 + 1] = line[j * 3 + 1]
                    block[j, r * 3 + 2] = line[j * 3 + 2]
            else:
                for j in range(ncol):
                    for ch in range(c):
                        block[j, r * c + ch] = line[j * c + ch]
        for x in range(nx):  # horizontal pass, the block's rows and channels as lanes
            hacc[:] = _HALF
            j0 = xs[ox0 + x] - sx0
            for k in range(0, taps - 1, 2):  # two taps per sweep over hacc
                w0, w1 = xw[ox0 + x, k], xw[ox0 + x, k + 1]
                c0, c1 = block[j0 + k], block[j0 + k + 1]
                if lanes == LANES:
                    for i in range(LANES):
                        hacc[i] += np.int32(c0[i]) * w0 + np.int32(c1[i]) * w1
                else:
                    for i in range(lanes):
                        hacc[i] += np.int32(c0[i]) * w0 + np.int32(c1[i]) * w1
            if taps % 2:
                w0 = xw[ox0 + x, taps - 1]
                c0 = block[j0 + taps - 1]
                for i in range(lanes):
                    hacc[i] += np.int32(c0[i]) * w0
            hb = hblock[x]
            for i in range(lanes):
                hb[i] = _clip8(hacc[i])
        _emit_block(hblock, rows, nx, c, lut, dst, dy + b0 - oy0, dx, mode)


@numba.njit(**_JIT)
def _emit_block(hblock, rows, nx, c, lut, dst, y, dx, mode):
    """A block's results, hblock[x, r * c + ch], written as `rows` rows from (y, dx)."""
    if mode == 0:
        for r in range(rows):
            d = dst[y + r]
            for x in range(nx):
                for ch in range(c):
                    d[dx + x, ch] = hblock[x, r * c + ch]
    elif mode == 1:
        for r in range(rows):
            for ch in range(c):
                t = lut[ch]
                d = dst[ch, y + r]
                for x in range(nx):
                    d[dx + x] = t[hblock[x, r * c + ch]]
    else:
        for r in range(rows):
            d = dst[y + r]
            for x in range(nx):
                for ch in range(c):
                    d[dx + x, ch] = lut[ch, hblock[x, r * c + ch]]


def resample_window(
    src: np.ndarray,
    out_hw: tuple[int, int],
    window: tuple[int, int, int, int],
    antialias: bool,
    dst: np.ndarray,
    offset: tuple[int, int] = (0, 0),
    lut: np.ndarray | None = None,
    chw: bool = False,
) -> None:
    """Rows y0:y1, columns x0:x1 of `src` resized to out_hw, written at `offset` into dst.

    With `lut`, each uint8 result v of channel c is written as lut[c, v] (normalize) into dst,
    in CHW or HWC order (float16 dst as its uint16 view).
    """
    if not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    h, w, _ = src.shape
    y0, y1, x0, x1 = window
    dy, dx = offset
    table, mode = lut_mode(lut, chw)
    resample(src, *tables(h, w, out_hw, antialias), y0, y1, x0, x1, table, dst, dy, dx, mode)


def tables(h: int, w: int, out_hw: tuple[int, int], antialias: bool) -> tuple:
    """(xs, xw, yb, yw): `resample`'s coefficient tables for an (h, w) source resized to
    out_hw; a caller that keeps them per source size calls `resample` itself."""
    oh, ow = out_hw
    return (*padded_coeffs(w, ow, antialias), *coeffs(h, oh, antialias))


def lut_mode(lut: np.ndarray | None, chw: bool) -> tuple[np.ndarray, int]:
    """`resample`'s (lut, mode) for writing through `lut` (None: plain uint8) in CHW or HWC."""
    return (_NO_LUT, 0) if lut is None else (lut, 1 if chw else 2)


_NO_LUT = np.zeros((1, 256), np.uint8)
