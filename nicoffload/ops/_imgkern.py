"""Numba loops shared by the image kernels besides resampling: crop with padding, normalize by
table or affine, CMYK conversion; and the Python helpers around them (per-thread scratch
buffers, warm-up inputs). Every loop releases the GIL.
"""

from __future__ import annotations

import math
import threading

import numba
import numpy as np

from nicoffload.ops.crop import crop_box

_JIT = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def fill_border(dst, value, y0, y1, x0, x1, chw):
    """dst[c] = value[c] outside the window [y0:y1, x0:x1] (the padding of a center crop)."""
    h, w = (dst.shape[1], dst.shape[2]) if chw else (dst.shape[0], dst.shape[1])
    for y in range(h):
        inside = y0 <= y < y1
        for x in range(0, x0 if inside else w):
            _put(dst, value, y, x, chw)
        if inside:
            for x in range(x1, w):
                _put(dst, value, y, x, chw)


@numba.njit(**_JIT)
def _put(dst, value, y, x, chw):
    for c in range(value.size):
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
    """Per-thread growable buffers, so the per-item path allocates nothing once warm.

    Buffers beyond KEEP_BYTES (a 12-megapixel RGB image) are handed out but not kept, so one
    huge image does not pin its memory to every worker thread for the rest of the run.
    """

    KEEP_BYTES = 36 << 20

    def __init__(self) -> None:
        self.bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8):
        n = math.prod(shape)
        dtype = np.dtype(dtype)
        if n * dtype.itemsize > self.KEEP_BYTES:
            return np.empty(shape, dtype)
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


def crop_window(h: int, w: int, ch: int, cw: int) -> tuple[tuple[int, int, int, int], tuple]:
    """The part of an (h, w) image inside the center crop (y0, y1, x0, x1), and where it lands."""
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
