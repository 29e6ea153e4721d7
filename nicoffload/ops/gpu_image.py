"""GPU kernels of the image ops: decode_image (nvJPEG), resize / center_crop / normalize and their
fused chains (one runtime-compiled resampler that computes only the output window's pixels).

Why one module and not a kernel beside each op's CPU kernel: the GPU kernels share one CUDA
source, one launch path and one batch calling convention, and the per-op files are being
reworked concurrently. The registry imports this module through `OP_MODULES`; nothing here
imports torch or CuPy until a kernel is built.

Batch calling convention (GPU kernels differ from the per-item contract in `Kernel`):
`fn(items, out=None, failed=None)` takes a whole batch: `items` is a list with one entry per
item (encoded bytes for decode_image; uint8 HWC images as CUDA tensors, or numpy arrays that are
then uploaded unstaged) or one CUDA tensor (N, H, W, C). It launches on torch's current stream
and returns a CUDA tensor (N, *shape) when the node's output shape is static (written into `out`
when given), else a list of per-item CUDA tensors. `failed` maps row -> ItemError: rows already
there are skipped (None in lists, zeros in tensors) and the kernel adds the rows it fails. With
`failed=None` the first failure is raised.

Semantics match the CPU kernels: Pillow's bilinear resampling (triangle filter widened by the
scale, 22-bit fixed-point weights computed in double in the same order, a uint8 intermediate
between the horizontal and the vertical pass), so resize and crop are bit-exact with
`Image.resize(BILINEAR)`; normalize computes fma(x, a, b) in float32, rounded once to the output
dtype. Decoding is nvJPEG's: its IDCT and chroma upsampling differ from libjpeg-turbo's by a few
uint8 levels (tests/device states the tolerance).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.ops import kernel
from nicoffload.ops.crop import crop_box
from nicoffload.ops.normalize import affine
from nicoffload.ops.resize import output_size

TILE_W, TILE_H = 32, 8  # one thread per output pixel of a 32x8 tile
# Shared memory one item may need (its taps tables and source rows); three such maxima together
# stay under the 227 KB a Hopper block may have.
SMEM_LIMIT = 72 * 1024
DESC = 16  # int64 fields per item descriptor

CUDA_SOURCE = r"""
#define TW 32
#define TH 8
#define PREC 22
#define DESC 16

__device__ __forceinline__ unsigned int clip8(int v) {
  v >>= PREC;
  return v < 0 ? 0u : (v > 255 ? 255u : (unsigned int)v);
}

__device__ __forceinline__ double tri(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for output index o, same double
// arithmetic in the same order (compiled with --fmad=false): bit-identical weights.
__device__ int taps(int o, int in_size, int out_size, int antialias, int* w, int* first) {
  double scale = (double)in_size / (double)out_size;
  double filterscale = (antialias && scale > 1.0) ? scale : 1.0;
  double support = 1.0 * filterscale;
  double center = (o + 0.5) * scale;
  double ss = 1.0 / filterscale;
  int xmin = (int)(center - support + 0.5);
  if (xmin < 0) xmin = 0;
  int xmax = (int)(center + support + 0.5);
  if (xmax > in_size) xmax = in_size;
  xmax -= xmin;
  double ww = 0.0;
  for (int x = 0; x < xmax; x++) ww += tri((x + xmin - center + 0.5) * ss);
  for (int x = 0; x < xmax; x++) {
    double k = tri((x + xmin - center + 0.5) * ss);
    if (ww != 0.0) k /= ww;
    w[x] = k < 0 ? (int)(-0.5 + k * (double)(1 << PREC)) : (int)(0.5 + k * (double)(1 << PREC));
  }
  *first = xmin;
  return xmax;
}

__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float cvt(float*, float x) { return x; }
__device__ __forceinline__ unsigned short cvt(unsigned short*, float x) { return f2h(x); }

template <typename T>
__device__ __forceinline__ T emit(unsigned int v, float a, float b) {
  return cvt((T*)0, __fmaf_rn((float)v, a, b));
}
template <>
__device__ __forceinline__ unsigned char emit<unsigned char>(unsigned int v, float, float) {
  return (unsigned char)v;
}

// The taps of every output column and row of every item, once per batch: entry = (first tap,
// tap count, weights...), kx + 2 ints per column and ky + 2 per row. Count 0: padding.
__global__ void taps_table(const long long* __restrict__ desc, int* __restrict__ tab,
                           int antialias, int kx, int ky, int wmax, int hmax) {
  const int item = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
  const long long* d = desc + (long long)DESC * item;
  int* tx = tab + (long long)item * (wmax * (kx + 2) + hmax * (ky + 2));
  int* ty = tx + wmax * (kx + 2);
  const int sh = (int)d[1], sw = (int)d[2], rh = (int)d[6], rw = (int)d[7];
  const int top = (int)d[8], left = (int)d[9], oh = (int)d[11], ow = (int)d[12];
  const bool live = d[0] != 0;
  if (o < wmax) {
    int* e = tx + o * (kx + 2);
    int rx = o + left, f = 0, n = 0;
    if (live && o < ow && rx >= 0 && rx < rw) n = taps(rx, sw, rw, antialias, e + 2, &f);
    e[0] = f;
    e[1] = n;
  }
  if (o < hmax) {
    int* e = ty + o * (ky + 2);
    int ry = o + top, f = 0, n = 0;
    if (live && o < oh && ry >= 0 && ry < rh) n = taps(ry, sh, rh, antialias, e + 2, &f);
    e[0] = f;
    e[1] = n;
  }
}

// One block = a TWxTH tile of one item's output window; blockIdx.z = item. The window origin
// (top, left) is in resized coordinates; pixels outside the resized image are padding (value 0).
template <typename T>
__global__ void __launch_bounds__(TW * TH) resample(
    const long long* __restrict__ desc, const int* __restrict__ tab, int wmax, int hmax,
    int C, int chw, int kx, int ky,
    float a0, float a1, float a2, float a3, float b0, float b1, float b2, float b3) {
  extern __shared__ int smem[];
  const int ex = kx + 2, ey = ky + 2;
  int* ct = smem;            // TW x (first, count, kx weights)
  int* rt = ct + TW * ex;    // TH x (first, count, ky weights)
  unsigned char* tmp = (unsigned char*)(rt + TH * ey);  // rows x TW x C, horizontal pass

  const long long* d = desc + (long long)DESC * blockIdx.z;
  const unsigned char* src = (const unsigned char*)d[0];
  const long long sc = d[3], sy = d[4], sx = d[5];
  T* dst = (T*)d[10];
  const int oh = (int)d[11], ow = (int)d[12];
  const int ox0 = blockIdx.x * TW, oy0 = blockIdx.y * TH;
  if (ox0 >= ow || oy0 >= oh) return;  // the same for the whole block
  const int tid = threadIdx.x;
  const bool live = src != 0;
  const int* tx = tab + (long long)blockIdx.z * (wmax * ex + hmax * ey);
  const int* ty = tx + wmax * ex;
  for (int i = tid; i < TW * ex; i += TW * TH)
    ct[i] = (ox0 + i / ex < wmax) ? tx[ox0 * ex + i] : 0;
  for (int i = tid; i < TH * ey; i += TW * TH)
    rt[i] = (oy0 + i / ey < hmax) ? ty[oy0 * ey + i] : 0;
  __syncthreads();

  int r0 = 0x7fffffff, r1 = 0;
  for (int t = 0; t < TH; t++) {
    if (live && rt[t * ey + 1] > 0) {
      r0 = min(r0, rt[t * ey]);
      r1 = max(r1, rt[t * ey] + rt[t * ey + 1]);
    }
  }
  const int nrows = r1 > r0 ? r1 - r0 : 0;
  for (int i = tid; i < nrows * TW; i += TW * TH) {
    const int r = i / TW, col = i - r * TW, n = ct[col * ex + 1];
    if (n == 0) continue;
    const unsigned char* row = src + (long long)(r0 + r) * sy + (long long)ct[col * ex] * sx;
    const int* w = ct + col * ex + 2;
    for (int c = 0; c < C; c++) {
      const unsigned char* p = row + c * sc;
      int acc = 1 << (PREC - 1);
      for (int k = 0; k < n; k++) acc += (int)p[k * sx] * w[k];
      tmp[(r * TW + col) * C + c] = (unsigned char)clip8(acc);
    }
  }
  __syncthreads();

  const int cx = tid % TW, cy = tid / TW, ox = ox0 + cx, oy = oy0 + cy;
  if (ox >= ow || oy >= oh) return;
  const int ny = rt[cy * ey + 1];
  const bool inside = live && ct[cx * ex + 1] > 0 && ny > 0;
  for (int c = 0; c < C; c++) {
    const float a = c == 0 ? a0 : c == 1 ? a1 : c == 2 ? a2 : a3;
    const float b = c == 0 ? b0 : c == 1 ? b1 : c == 2 ? b2 : b3;
    unsigned int v = 0;
    if (inside) {
      const int* w = rt + cy * ey + 2;
      const unsigned char* p = tmp + ((rt[cy * ey] - r0) * TW + cx) * C + c;
      int acc = 1 << (PREC - 1);
      for (int k = 0; k < ny; k++) acc += (int)p[k * TW * C] * w[k];
      v = clip8(acc);
    }
    T out = live ? emit<T>(v, a, b) : (T)0;
    if (chw) dst[((long long)c * oh + oy) * ow + ox] = out;
    else dst[((long long)oy * ow + ox) * C + c] = out;
  }
}

// Streaming stores (evict-first): a normalized batch is written once and read by someone else.
__device__ __forceinline__ void store16(float* p, const float* v) {
  for (int i = 0; i < 16; i += 4)
    __stcs((float4*)(p + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
}
__device__ __forceinline__ void store16(unsigned short* p, const unsigned short* v) {
  uint4 u, w;
  u.x = v[0] | ((unsigned)v[1] << 16); u.y = v[2] | ((unsigned)v[3] << 16);
  u.z = v[4] | ((unsigned)v[5] << 16); u.w = v[6] | ((unsigned)v[7] << 16);
  w.x = v[8] | ((unsigned)v[9] << 16); w.y = v[10] | ((unsigned)v[11] << 16);
  w.z = v[12] | ((unsigned)v[13] << 16); w.w = v[14] | ((unsigned)v[15] << 16);
  __stcs((uint4*)p, u);
  __stcs((uint4*)(p + 8), w);
}
__device__ __forceinline__ void store16(unsigned char* p, const unsigned char* v) {
  uint4 u;
  u.x = v[0] | (v[1] << 8) | (v[2] << 16) | ((unsigned)v[3] << 24);
  u.y = v[4] | (v[5] << 8) | (v[6] << 16) | ((unsigned)v[7] << 24);
  u.z = v[8] | (v[9] << 8) | (v[10] << 16) | ((unsigned)v[11] << 24);
  u.w = v[12] | (v[13] << 8) | (v[14] << 16) | ((unsigned)v[15] << 24);
  __stcs((uint4*)p, u);
}

// normalize of a dense batch: contiguous (N, H, W, 3) uint8, H*W % 16 == 0, 16-byte aligned.
// blockIdx.y = image; one thread = 16 pixels: three 16-byte loads, 16-byte stores.
template <typename T>
__global__ void __launch_bounds__(128) affine_dense(
    const unsigned char* __restrict__ src, T* __restrict__ dst, int hw, int chw,
    float a0, float a1, float a2, float b0, float b1, float b2) {
  const int q = (blockIdx.x * blockDim.x + threadIdx.x) * 16;
  if (q >= hw) return;
  const long long n = blockIdx.y;
  const uint4* p = (const uint4*)(src + (n * hw + q) * 3);
  uint4 q0 = __ldcs(p), q1 = __ldcs(p + 1), q2 = __ldcs(p + 2);
  const unsigned int wd[12] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w,
                               q2.x, q2.y, q2.z, q2.w};
  T r[16], gg[16], bb[16];
#pragma unroll
  for (int i = 0; i < 16; i++) {
    r[i] = emit<T>((wd[(3 * i) >> 2] >> (((3 * i) & 3) * 8)) & 255u, a0, b0);
    gg[i] = emit<T>((wd[(3 * i + 1) >> 2] >> (((3 * i + 1) & 3) * 8)) & 255u, a1, b1);
    bb[i] = emit<T>((wd[(3 * i + 2) >> 2] >> (((3 * i + 2) & 3) * 8)) & 255u, a2, b2);
  }
  if (chw) {
    T* base = dst + n * 3 * hw + q;
    store16(base, r);
    store16(base + hw, gg);
    store16(base + 2 * (long long)hw, bb);
  } else {
    T v[48];
#pragma unroll
    for (int i = 0; i < 16; i++) {
      v[3 * i] = r[i];
      v[3 * i + 1] = gg[i];
      v[3 * i + 2] = bb[i];
    }
    T* base = dst + (n * hw + q) * 3;
    store16(base, v);
    store16(base + 16, v + 16);
    store16(base + 32, v + 32);
  }
}
"""

_CTYPES = {"uint8": "unsigned char", "float32": "float", "float16": "unsigned short"}
_NAMES = (
    "taps_table",
    *(f"{k}<{t}>" for k in ("resample", "affine_dense") for t in _CTYPES.values()),
)
_OPTIONS = ("--std=c++17", "--fmad=false")


def _torch_dtype(torch: Any, name: str) -> Any:
    return {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16}[name]


def _launch(gpu: Any, fn: Any, grid: tuple[int, ...], block: int, args: tuple) -> None:
    with gpu.cupy_stream():
        fn(grid, (block,), args)


def _ksize(in_size: int, out_size: int, antialias: bool) -> tuple[int, float]:
    scale = in_size / out_size
    support = scale if (antialias and scale > 1.0) else 1.0
    return math.ceil(support) * 2 + 1, support


def _smem(c: int, kx: int, ky: int, rows: int) -> int:
    return 4 * (TILE_W * kx + TILE_H * ky + 2 * TILE_W + 2 * TILE_H) + rows * TILE_W * c


@dataclass(frozen=True)
class _Chain:
    """What an image chain computes, read from its nodes once at build time."""

    resize: dict | None
    crop: tuple[int, int] | None
    norm: tuple[tuple[float, ...], tuple[float, ...], str, str] | None  # a, b, dtype, layout
    channels: int
    static: bool
    in_dtype: str

    @classmethod
    def of(cls, nodes: Sequence[Any]) -> _Chain:
        by_op = {n.op: n for n in nodes}
        first = nodes[0]
        c = first.in_specs[0].shape[2] if len(first.in_specs[0].shape) == 3 else 3
        norm = None
        if "normalize" in by_op:
            p = by_op["normalize"].params
            a, b = affine(p)
            norm = (a, b, p["dtype"], p["layout"])
        return cls(
            resize=by_op["resize"].params if "resize" in by_op else None,
            crop=tuple(by_op["center_crop"].params["size"]) if "center_crop" in by_op else None,
            norm=norm,
            channels=c if isinstance(c, int) else 3,
            static=nodes[-1].out.static,
            in_dtype=first.in_specs[0].dtype,
        )

    def geometry(self, h: int, w: int) -> tuple[int, int, int, int, int, int]:
        """(resized h, w, window top, left, output h, w) for an input of (h, w)."""
        rh, rw = output_size(self.resize, h, w) if self.resize else (h, w)
        if self.crop:
            ch, cw = self.crop
            top, left = crop_box(rh, rw, ch, cw)
            return rh, rw, top, left, ch, cw
        return rh, rw, 0, 0, rh, rw

    def out_shape(self, oh: int, ow: int) -> tuple[int, int, int]:
        if self.norm and self.norm[3] == "chw":
            return (self.channels, oh, ow)
        return (oh, ow, self.channels)

    @property
    def out_dtype(self) -> str:
        return self.norm[2] if self.norm else "uint8"


def _fail(failed: dict[int, ItemError] | None, row: int, error: ItemError) -> None:
    if failed is None:
        raise error
    failed[row] = error


def _rows(gpu: Any, items: Any) -> list[Any]:
    """Per-item CUDA tensors (views of a batch tensor; numpy arrays uploaded); None stays None."""
    torch = gpu.torch
    if isinstance(items, torch.Tensor):
        items = items if items.is_cuda else gpu.upload(items)
        return list(items.unbind(0))
    return [
        None if x is None else (x if isinstance(x, torch.Tensor) and x.is_cuda else gpu.upload(x))
        for x in items
    ]


@dataclass
class _Launch:
    """A prepared batch: grid, kernel arguments, shared memory, its outputs (and descriptors)."""

    grid: tuple[int, int, int] | None
    args: tuple
    smem: int
    result: Any
    buffers: Any  # descriptors and taps table, kept alive until the launches are issued
    taps: tuple  # grid and arguments of the taps-table kernel


class _ImageKernel:
    """The batch function of one image chain on the GPU (see the module docstring)."""

    def __init__(self, nodes: Sequence[Any]) -> None:
        from nicoffload.devices.gpu import device

        self.gpu = device()
        self.chain = _Chain.of(nodes)
        last = nodes[-1].out
        self.static_shape = tuple(last.shape) if last.static else None
        if self.static_shape is not None:
            chw = self.chain.norm is not None and self.chain.norm[3] == "chw"
            self.static_window = self.static_shape[1:] if chw else self.static_shape[:2]
        self.antialias = bool(self.chain.resize["antialias"]) if self.chain.resize else True
        mod = self.gpu.module(CUDA_SOURCE, _NAMES, _OPTIONS)
        ctype = _CTYPES[self.chain.out_dtype]
        self.resample = mod.get_function(f"resample<{ctype}>")
        self.taps_table = mod.get_function("taps_table")
        self.dense = mod.get_function(f"affine_dense<{ctype}>")
        self.smem_set = 48 * 1024
        a, b = (self.chain.norm[0], self.chain.norm[1]) if self.chain.norm else ((1.0,), (0.0,))
        pad = 4 - len(a)
        self.ab = tuple(np.float32(v) for v in (*a, *([0.0] * pad), *b, *([0.0] * pad)))
        self._geometry = functools.lru_cache(maxsize=4096)(self.geometry)

    def geometry(self, h: int, w: int, c: int) -> tuple[int, ...]:
        """Per input size (cached): h, w, resized h, w, window top, left, out h, w, taps x, y,
        source rows per tile, shared memory bytes."""
        rh, rw, top, left, oh, ow = self.chain.geometry(h, w)
        kx, _ = _ksize(w, rw, self.antialias)
        ky, support = _ksize(h, rh, self.antialias)
        rows = math.ceil((TILE_H - 1) * h / rh + 2 * support + 2)
        return (h, w, rh, rw, top, left, oh, ow, kx, ky, rows, _smem(c, kx, ky, rows))

    def __call__(self, items: Any, out: Any = None, failed: dict | None = None) -> Any:
        if self.chain.in_dtype != "uint8":
            return self._float(items, out, failed)
        if self._dense_ok(items, failed):
            return self._dense(items, out)
        launch = self.prepare(items, out, failed)
        self.launch(launch)
        return launch.result

    def prepare(self, items: Any, out: Any = None, failed: dict | None = None) -> _Launch:
        """The host half: descriptors (one int64 row per item) and outputs, nothing launched."""
        rows = _rows(self.gpu, items)
        n = len(rows)
        skip = failed or {}
        live = [i for i, x in enumerate(rows) if x is not None and i not in skip]
        geo = [self._geometry(*rows[i].shape) for i in live]
        if any(g[11] > SMEM_LIMIT for g in geo):
            for i, g in zip(live, geo, strict=True):
                if g[11] > SMEM_LIMIT:
                    reason = f"{g[0]}x{g[1]} -> {g[2]}x{g[3]} is beyond the GPU resampler's tile"
                    _fail(failed, i, ItemError("too_large", reason))
            keep = [j for j, g in enumerate(geo) if g[11] <= SMEM_LIMIT]
            live, geo = [live[j] for j in keep], [geo[j] for j in keep]
        desc = np.zeros((n, DESC), np.int64)
        dtype = _torch_dtype(self.gpu.torch, self.chain.out_dtype)
        if self.static_shape is not None:
            result = out if out is not None else self.gpu.empty((n, *self.static_shape), dtype)
            row_bytes = result.stride(0) * result.element_size()
            desc[:, 10] = result.data_ptr() + np.arange(n, dtype=np.int64) * row_bytes
            desc[:, 11:13] = self.static_window  # failed rows keep src 0: the kernel zeroes them
        else:
            result = [None] * n
        kx = ky = 3
        rows_max = 1
        if live:
            g = np.array(geo, np.int64)
            at = np.array(live)
            desc[at, 0] = [rows[i].data_ptr() for i in live]
            desc[at, 1:3] = g[:, 0:2]
            desc[at, 3:6] = [(s[2], s[0], s[1]) for s in (rows[i].stride() for i in live)]
            desc[at, 6:10] = g[:, 2:6]
            if self.static_shape is None:
                for i, (*_, oh, ow, _kx, _ky, _r, _m) in zip(live, geo, strict=True):
                    result[i] = self.gpu.empty(self.chain.out_shape(oh, ow), dtype)
                desc[at, 10] = [result[i].data_ptr() for i in live]
                desc[at, 11:13] = g[:, 6:8]
            kx, ky, rows_max = (int(v) for v in g[:, 8:11].max(axis=0))
        gh, gw = int(desc[:, 11].max(initial=0)), int(desc[:, 12].max(initial=0))
        torch = self.gpu.torch
        d = torch.from_numpy(desc).to(self.gpu.device, non_blocking=True)
        tab = torch.empty(
            max(1, n * (gw * (kx + 2) + gh * (ky + 2))), dtype=torch.int32, device=d.device
        )
        chw = self.chain.norm is not None and self.chain.norm[3] == "chw"
        i32 = np.int32
        taps = (
            (-(-max(gw, gh) // 128), n),
            (
                np.uint64(d.data_ptr()),
                np.uint64(tab.data_ptr()),
                *(i32(v) for v in (self.antialias, kx, ky, gw, gh)),
            ),
        )
        grid = (-(-gw // TILE_W), -(-gh // TILE_H), n) if gh and gw else None
        args = (
            np.uint64(d.data_ptr()),
            np.uint64(tab.data_ptr()),
            *(i32(v) for v in (gw, gh, self.chain.channels, chw, kx, ky)),
            *self.ab,
        )
        smem = _smem(self.chain.channels, kx, ky, rows_max)
        return _Launch(grid, args, smem, result, (d, tab), taps)

    def launch(self, launch: _Launch) -> None:
        """The device half: the batch's taps table, then one resampling kernel, on the current
        stream."""
        if launch.grid is None:
            return
        if launch.smem > self.smem_set:
            self.resample.max_dynamic_shared_size_bytes = launch.smem
            self.smem_set = launch.smem
        grid, args = launch.taps
        with self.gpu.cupy_stream():
            self.taps_table(grid, (128,), args)
            self.resample(launch.grid, (TILE_W * TILE_H,), launch.args, shared_mem=launch.smem)

    def _dense_ok(self, items: Any, failed: dict | None) -> bool:
        torch = self.gpu.torch
        return (
            self.chain.norm is not None
            and self.chain.resize is None
            and self.chain.crop is None
            and not failed
            and isinstance(items, torch.Tensor)
            and items.is_cuda
            and items.dim() == 4
            and items.shape[3] == 3
            and items.is_contiguous()
            and (items.shape[1] * items.shape[2]) % 16 == 0
            and items.data_ptr() % 16 == 0
        )

    def _dense(self, items: Any, out: Any) -> Any:
        torch = self.gpu.torch
        n, h, w, _ = items.shape
        dtype = _torch_dtype(torch, self.chain.out_dtype)
        if out is None:
            out = self.gpu.empty((n, *self.chain.out_shape(h, w)), dtype)
        blocks = -(-(h * w) // (16 * 128))
        a, b = self.ab[:3], self.ab[4:7]
        chw = int(self.chain.norm[3] == "chw")
        args = (
            np.uint64(items.data_ptr()),
            np.uint64(out.data_ptr()),
            np.int32(h * w),
            np.int32(chw),
            *a,
            *b,
        )
        _launch(self.gpu, self.dense, (blocks, n), 128, args)
        return out

    def _float(self, items: Any, out: Any, failed: dict | None) -> Any:
        """float32 inputs (center_crop / normalize only): plain torch, correct before fast."""
        torch = self.gpu.torch
        rows = _rows(self.gpu, items)
        res: list[Any] = []
        for i, x in enumerate(rows):
            if x is None or (failed is not None and i in failed):
                res.append(None)
                continue
            h, w, _ = x.shape
            _, _, top, left, oh, ow = self.chain.geometry(h, w)
            y = torch.zeros((oh, ow, x.shape[2]), dtype=x.dtype, device=x.device)
            t0, l0 = max(top, 0), max(left, 0)
            t1, l1 = min(top + oh, h), min(left + ow, w)
            y[t0 - top : t1 - top, l0 - left : l1 - left] = x[t0:t1, l0:l1]
            if self.chain.norm:
                a = torch.tensor(self.chain.norm[0], dtype=torch.float32, device=x.device)
                b = torch.tensor(self.chain.norm[1], dtype=torch.float32, device=x.device)
                y = torch.addcmul(b, y.float(), a).to(_torch_dtype(torch, self.chain.out_dtype))
                if self.chain.norm[3] == "chw":
                    y = y.permute(2, 0, 1)
            res.append(y)
        if not self.chain.static:
            return res
        shape = next((r.shape for r in res if r is not None), None)
        batch = out if out is not None else self.gpu.empty((len(res), *shape), res[0].dtype)
        for i, r in enumerate(res):
            batch[i] = 0 if r is None else r
        return batch


def _build_image_chain(nodes, consumers):
    """GPU (CuPy raw kernel): Pillow-exact antialiased bilinear resize, center crop and normalize,
    computing only the output window; one launch per batch. `fn` takes a whole batch."""
    return _ImageKernel(nodes)


for _chain in (
    ("resize",),
    ("center_crop",),
    ("normalize",),
    ("resize", "center_crop"),
    ("center_crop", "normalize"),
    ("resize", "center_crop", "normalize"),
):
    kernel(_chain, "gpu", batched=True)(_build_image_chain)


# --- decode_image ----------------------------------------------------------------------------

# What goes to nvJPEG: 3-component baseline, extended and progressive Huffman JPEGs. The rest
# goes to the CPU decoder: PNG, CMYK, arithmetic coding, and 1-component (gray) JPEGs, for
# which nvJPEG's batched path returned blank images on the H200 (torchvision 0.26, CUDA 13).
_SOF = {0xC0, 0xC1, 0xC2}


def jpeg_header(data: bytes) -> tuple[int, int, int, int] | None:
    """(height, width, components, SOF marker) of a JPEG, or None when it is not one."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            i += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                return None
            h = (data[i + 5] << 8) | data[i + 6]
            w = (data[i + 7] << 8) | data[i + 8]
            return h, w, data[i + 9], marker
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


@dataclass
class DecodeStats:
    """Where a decoder's items went: nvJPEG, the CPU fallback, or failure."""

    gpu: int = 0
    cpu_fallback: int = 0
    failed: int = 0


@dataclass
class DecodeJob:
    """One batch between the decoder's three phases (prepare, run, finish)."""

    n: int
    gpu_rows: list[int] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)
    cpu_rows: list[int] = field(default_factory=list)
    cpu_items: list[Any] = field(default_factory=list)
    decoded: list[Any] | None = None


class _Decoder:
    """nvJPEG batch decode through torchvision; the CPU decoder takes what nvJPEG rejects.

    Three phases, so a pipeline can keep nvJPEG busy: `prepare` (host, Python), `run` (the
    nvJPEG call only, GIL released), `finish` (views, fallbacks); `fn(items)` runs all three.
    """

    def __init__(self, node: Any) -> None:
        import warnings

        from nicoffload.devices.gpu import device, torchvision_io

        self.gpu = device()
        self.io = torchvision_io()
        gray = node.params["color"] == "gray"
        self.channels = 1 if gray else 3
        # Always RGB from nvJPEG; gray output is computed from it as libjpeg does (BT.601 in
        # 16-bit fixed point), one path for every image nvJPEG takes.
        self.mode = self.io.ImageReadMode.RGB
        self._luma = None
        self.max_pixels = node.params["max_pixels"]
        self.stats = DecodeStats()
        self._cpu = self._cpu_decoder(node)
        with warnings.catch_warnings():  # torch warns once that bytes are read-only: we only read
            warnings.simplefilter("ignore")
            self.gpu.torch.frombuffer(b"\xff", dtype=self.gpu.torch.uint8)

    def _cpu_decoder(self, node: Any) -> Any:
        from nicoffload import ops

        try:  # the CPU kernel, at full size (no DCT scaling: same geometry as nvJPEG's output)
            k = ops.get_kernel("decode_image", "cpu")
        except KeyError:
            return self._pil
        return k.build([node], ())

    def _pil(self, data: bytes) -> np.ndarray:
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                arr = np.asarray(im.convert("L" if self.channels == 1 else "RGB"))
        except Exception as exc:
            raise ItemError("corrupt", f"cannot decode the image: {exc}") from None
        return arr[..., None] if arr.ndim == 2 else arr

    def __call__(self, items: Sequence[Any], out: Any = None, failed: dict | None = None) -> list:
        job = self.prepare(items, failed)
        self.run(job)
        return self.finish(job, failed)

    def prepare(self, items: Sequence[Any], failed: dict | None = None) -> DecodeJob:
        """Host only: read headers (refusing bombs), route each item, wrap bytes for nvJPEG."""
        torch = self.gpu.torch
        job = DecodeJob(len(items))
        for i, data in enumerate(items):
            if data is None or (failed is not None and i in failed):
                continue
            head = jpeg_header(data)
            if head is not None and head[0] * head[1] > self.max_pixels:
                self.stats.failed += 1
                _fail(failed, i, ItemError("too_large", f"{head[1]}x{head[0]} exceeds max_pixels"))
            elif head is not None and head[3] in _SOF and head[2] == 3 and head[0] and head[1]:
                job.gpu_rows.append(i)
                job.tensors.append(torch.frombuffer(data, dtype=torch.uint8))
            else:
                job.cpu_rows.append(i)
                job.cpu_items.append(data)
        return job

    def _gray(self, img: Any) -> Any:
        """uint8 (H, W, 1) luma of a (3, H, W) RGB image: (19595 R + 38470 G + 7471 B) >> 16."""
        torch = self.gpu.torch
        if self._luma is None:
            self._luma = torch.tensor([19595, 38470, 7471], dtype=torch.int32, device=img.device)
        y = (img.to(torch.int32) * self._luma[:, None, None]).sum(0).add_(32768) >> 16
        return y.to(torch.uint8)[..., None]

    def run(self, job: DecodeJob) -> None:
        """nvJPEG on the batch (torchvision releases the GIL and returns once decoded)."""
        if not job.tensors:
            return
        try:
            job.decoded = self.io.decode_jpeg(job.tensors, mode=self.mode, device=self.gpu.device)
        except RuntimeError:  # one bad item fails the batch call: find it
            job.decoded = []
            for t in job.tensors:
                try:
                    one = self.io.decode_jpeg([t], mode=self.mode, device=self.gpu.device)
                    job.decoded.append(one[0])
                except RuntimeError:
                    job.decoded.append(None)

    def finish(self, job: DecodeJob, failed: dict | None = None) -> list:
        """HWC views of nvJPEG's planes; the CPU decoder for what nvJPEG could not read."""
        res: list[Any] = [None] * job.n
        cpu = list(zip(job.cpu_rows, job.cpu_items, strict=True))
        for i, t, img in zip(job.gpu_rows, job.tensors, job.decoded or (), strict=True):
            if img is None:
                cpu.append((i, t.numpy().tobytes()))
            else:
                res[i] = self._gray(img) if self.channels == 1 else img.permute(1, 2, 0)
        self.stats.gpu += sum(r is not None for r in res)
        for i, data in sorted(cpu, key=lambda p: p[0]):
            try:
                arr = self._cpu(data)
            except ItemError as exc:
                self.stats.failed += 1
                _fail(failed, i, exc)
                continue
            self.stats.cpu_fallback += 1
            res[i] = self.gpu.upload(np.require(arr, requirements=["C", "W"]))
        return res


@kernel("decode_image", "gpu", batched=True)
def _build_decode(nodes, consumers):
    """GPU (nvJPEG through torchvision, batched; hardware engine where the GPU has one).
    Host bytes in, uint8 HWC CUDA tensors out (RGB: views of CHW planes); the CPU decoder takes
    what nvJPEG rejects (counted in `fn.stats`). `fn` takes a whole batch."""
    return _Decoder(nodes[0])
