"""Numba loops shared by the image kernels: PIL-exact separable resampling, crop, LUT normalize.

Resampling reproduces Pillow's `ImagingResample` for 8-bit images (triangle filter widened by the
downscale factor, 22-bit fixed-point weights, a uint8 intermediate between the horizontal and the
vertical pass), so results match `Image.resize(..., BILINEAR)` bit for bit. Every loop can work on
a window of the output, which is what lets the fused kernels compute only the cropped pixels.
Every function releases the GIL; the Python helpers here hold the per-thread scratch buffers.
"""

from __future__ import annotations

import threading
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
def _clip8(v):
    v >>= PRECISION_BITS
    return 0 if v < 0 else (255 if v > 255 else v)


@numba.njit(**_JIT)
def _hpass(src, xb, xk, ox0, ox1, sy0, sy1, tmp):
    """tmp[y - sy0, x - ox0] = horizontally resampled src row y, output column x."""
    nc = src.shape[2]
    for y in range(sy0, sy1):
        row = src[y]
        trow = tmp[y - sy0]
        for x in range(ox0, ox1):
            x0 = xb[x, 0]
            n = xb[x, 1]
            if nc == 3:
                a0 = a1 = a2 = _HALF
                for k in range(n):
                    w = xk[x, k]
                    a0 += np.int32(row[x0 + k, 0]) * w
                    a1 += np.int32(row[x0 + k, 1]) * w
                    a2 += np.int32(row[x0 + k, 2]) * w
                trow[x - ox0, 0] = _clip8(a0)
                trow[x - ox0, 1] = _clip8(a1)
                trow[x - ox0, 2] = _clip8(a2)
            else:
                for c in range(nc):
                    a = _HALF
                    for k in range(n):
                        a += np.int32(row[x0 + k, c]) * xk[x, k]
                    trow[x - ox0, c] = _clip8(a)


@numba.njit(**_JIT)
def _vrow(tmp, sy0, yb, yk, oy, acc, line):
    """line[:] = output row oy of the vertical pass over tmp (rows from sy0), as uint8."""
    flat = tmp.reshape(tmp.shape[0], -1)
    n = flat.shape[1]
    acc[:n] = _HALF
    y0 = yb[oy, 0] - sy0
    for k in range(yb[oy, 1]):
        w = yk[oy, k]
        r = flat[y0 + k]
        for i in range(n):
            acc[i] += np.int32(r[i]) * w
    for i in range(n):
        line[i] = _clip8(acc[i])


@numba.njit(**_JIT)
def resample_u8(src, xb, xk, yb, yk, oy0, oy1, ox0, ox1, tmp, acc, dst, dy, dx):
    """resized[oy0:oy1, ox0:ox1] into dst[dy:, dx:] (uint8 HWC); tmp holds the needed rows."""
    sy0 = yb[oy0, 0]
    sy1 = yb[oy1 - 1, 0] + yb[oy1 - 1, 1]
    _hpass(src, xb, xk, ox0, ox1, sy0, sy1, tmp)
    nc = src.shape[2]
    line = np.empty((ox1 - ox0) * nc, np.uint8)
    for oy in range(oy0, oy1):
        _vrow(tmp, sy0, yb, yk, oy, acc, line)
        drow = dst[dy + oy - oy0].reshape(-1)
        base = dx * nc
        for i in range(line.size):
            drow[base + i] = line[i]


@numba.njit(**_JIT)
def _emit_lut(line, lut, dst, y, dx, chw):
    nc = lut.shape[0]
    w = line.size // nc
    for c in range(nc):
        t = lut[c]
        if chw:
            d = dst[c, y]
            for x in range(w):
                d[dx + x] = t[line[x * nc + c]]
        else:
            d = dst[y]
            for x in range(w):
                d[dx + x, c] = t[line[x * nc + c]]


@numba.njit(**_JIT)
def resample_lut(src, xb, xk, yb, yk, oy0, oy1, ox0, ox1, tmp, acc, lut, dst, dy, dx, chw):
    """Like resample_u8, each uint8 result then mapped through lut[c] (normalize) into dst."""
    sy0 = yb[oy0, 0]
    sy1 = yb[oy1 - 1, 0] + yb[oy1 - 1, 1]
    _hpass(src, xb, xk, ox0, ox1, sy0, sy1, tmp)
    line = np.empty((ox1 - ox0) * src.shape[2], np.uint8)
    for oy in range(oy0, oy1):
        _vrow(tmp, sy0, yb, yk, oy, acc, line)
        _emit_lut(line, lut, dst, dy + oy - oy0, dx, chw)


@numba.njit(**_JIT)
def fill_border(dst, value, y0, y1, x0, x1, chw):
    """dst[c] = value[c] outside the window [y0:y1, x0:x1] (the padding of a center crop)."""
    nc = value.size
    h, w = (dst.shape[1], dst.shape[2]) if chw else (dst.shape[0], dst.shape[1])
    for y in range(h):
        inside_row = y0 <= y < y1
        for x in range(w):
            if inside_row and x0 <= x < x1:
                continue
            for c in range(nc):
                if chw:
                    dst[c, y, x] = value[c]
                else:
                    dst[y, x, c] = value[c]


@numba.njit(**_JIT)
def crop_copy(src, sy, sx, dst, dy, dx, h, w):
    """dst[dy:dy+h, dx:dx+w] = src[sy:sy+h, sx:sx+w] (HWC, any dtype)."""
    for y in range(h):
        s = src[sy + y]
        d = dst[dy + y]
        for x in range(w):
            for c in range(src.shape[2]):
                d[dx + x, c] = s[sx + x, c]


@numba.njit(**_JIT)
def crop_lut(src, sy, sx, lut, dst, dy, dx, h, w, chw):
    """dst window = lut[c][src window] (uint8 HWC in; normalize's table; CHW or HWC out)."""
    nc = src.shape[2]
    for y in range(h):
        s = src[sy + y]
        for c in range(nc):
            t = lut[c]
            if chw:
                d = dst[c, dy + y]
                for x in range(w):
                    d[dx + x] = t[s[sx + x, c]]
            else:
                d = dst[dy + y]
                for x in range(w):
                    d[dx + x, c] = t[s[sx + x, c]]


@numba.njit(**_JIT)
def crop_affine(src, sy, sx, a, b, dst, dy, dx, h, w, chw):
    """dst window = src window * a[c] + b[c] in float32 (float input to normalize)."""
    nc = src.shape[2]
    for y in range(h):
        s = src[sy + y]
        for c in range(nc):
            ac = np.float32(a[c])
            bc = np.float32(b[c])
            for x in range(w):
                v = np.float32(s[sx + x, c]) * ac + bc
                if chw:
                    dst[c, dy + y, dx + x] = v
                else:
                    dst[dy + y, dx + x, c] = v


@numba.njit(**_JIT)
def cmyk_convert(src, dst):
    """Adobe (inverted) CMYK as libjpeg returns it -> RGB (or L), exactly as Pillow's convert."""
    h, w = src.shape[0], src.shape[1]
    for y in range(h):
        for x in range(w):
            nk = np.int32(src[y, x, 3])  # Pillow: cmyk = 255 - stored, so nk = 255 - k = stored k
            r = g = b = 0
            for c in range(3):
                t = (255 - np.int32(src[y, x, c])) * nk + 128
                v = nk - (((t >> 8) + t) >> 8)
                if dst.shape[2] == 3:
                    dst[y, x, c] = v
                elif c == 0:
                    r = v
                elif c == 1:
                    g = v
                else:
                    b = v
            if dst.shape[2] == 1:  # Pillow's L24: ITU-R 601-2 luma in 16-bit fixed point
                dst[y, x, 0] = (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16


class Scratch(threading.local):
    """Per-thread growable buffers, so the per-item path allocates nothing once warm."""

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8):
        n = int(np.prod(shape))
        dtype = np.dtype(dtype)
        buf = self.bufs.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = np.empty(max(n, 1) + (n >> 2), dtype)
            self.bufs[name] = buf
        return buf[:n].reshape(shape)


def norm_lut(a, b, dtype: str) -> np.ndarray:
    """lut[c, v] = v * a[c] + b[c] for every uint8 v, in float64 rounded once to `dtype`.

    float16 tables are returned as their uint16 bit patterns (numba has no float16 type); the
    kernel writes them into a uint16 view of the float16 output.
    """
    v = np.arange(256, dtype=np.float64)
    table = v[None, :] * np.asarray(a, np.float64)[:, None] + np.asarray(b, np.float64)[:, None]
    out = table.astype(dtype)
    return out.view(np.uint16) if out.dtype == np.float16 else out


def as_numba_dst(out: np.ndarray) -> np.ndarray:
    """The array numba writes into: float16 outputs go through their uint16 view."""
    return out.view(np.uint16) if out.dtype == np.float16 else out


def resample_window(
    src: np.ndarray,
    out_hw: tuple[int, int],
    window: tuple[int, int, int, int],
    antialias: bool,
    scratch: Scratch,
    dst: np.ndarray,
    offset: tuple[int, int] = (0, 0),
    lut: np.ndarray | None = None,
    chw: bool = False,
) -> None:
    """Rows y0:y1, columns x0:x1 of `src` resized to out_hw, written at `offset` into dst.

    With `lut`, each uint8 result v of channel c is written as lut[c, v] (normalize) into dst,
    in CHW or HWC order. dst must be C-contiguous (float16 as its uint16 view).
    """
    h, w, c = src.shape
    oh, ow = out_hw
    y0, y1, x0, x1 = window
    xb, xk = coeffs(w, ow, antialias)
    yb, yk = coeffs(h, oh, antialias)
    rows = int(yb[y1 - 1, 0] + yb[y1 - 1, 1] - yb[y0, 0])
    tmp = scratch.get("resample_tmp", (rows, x1 - x0, c))
    acc = scratch.get("resample_acc", ((x1 - x0) * c,), np.int32)
    dy, dx = offset
    if lut is None:
        resample_u8(src, xb, xk, yb, yk, y0, y1, x0, x1, tmp, acc, dst, dy, dx)
    else:
        resample_lut(src, xb, xk, yb, yk, y0, y1, x0, x1, tmp, acc, lut, dst, dy, dx, chw)


def crop_window(h: int, w: int, ch: int, cw: int) -> tuple[tuple[int, int, int, int], tuple]:
    """The part of an (h, w) image inside the center crop (y0, y1, x0, x1), and where it lands."""
    from nicoffload.ops.crop import crop_box

    top, left = crop_box(h, w, ch, cw)
    y0, y1 = max(top, 0), min(top + ch, h)
    x0, x1 = max(left, 0), min(left + cw, w)
    return (y0, y1, x0, x1), (y0 - top, x0 - left)


def warm_inputs(c: int = 3, dtype: str = "uint8") -> list[np.ndarray]:
    """Small images in both memory layouts kernels meet (contiguous, and a cropped view)."""
    base = (np.arange(48 * 40 * c) % 251).astype(dtype).reshape(48, 40, c)
    return [base, base[2:46, 3:37]]


def contiguous_out(fn):
    """Let a kernel that writes through numba take any `out`: a non-contiguous one is filled
    from the kernel's own contiguous result (one copy, only on that unusual path)."""

    def wrapped(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None or out.flags.c_contiguous:
            return fn(x, out)
        out[...] = fn(x, None)
        return out

    wrapped.__doc__ = fn.__doc__
    return wrapped
