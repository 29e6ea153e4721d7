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
from dataclasses import dataclass
from pathlib import Path
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
DENSE_BLOCK = 256  # threads per block of the dense normalize (affine_dense)
DESC = 16  # int64 fields per item descriptor

# The CUDA source is a file of its own next to this module (compiled once per process by CuPy).
CUDA_SOURCE_FILE = Path(__file__).with_name("gpu_resample.cu")


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
        mod = self.gpu.module(CUDA_SOURCE_FILE.read_text(), _NAMES, _OPTIONS)
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
        if self._dense_ok(items, out, failed):
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

    def _dense_ok(self, items: Any, out: Any, failed: dict | None) -> bool:
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
            and (out is None or (out.is_contiguous() and out.data_ptr() % 16 == 0))
        )

    def _dense(self, items: Any, out: Any) -> Any:
        torch = self.gpu.torch
        n, h, w, _ = items.shape
        dtype = _torch_dtype(torch, self.chain.out_dtype)
        if out is None:
            out = self.gpu.empty((n, *self.chain.out_shape(h, w)), dtype)
        a, b = self.ab[:3], self.ab[4:7]
        chw = int(self.chain.norm[3] == "chw")
        units = (
            n * h * w * (1 if chw else 3)
        )  # a thread takes 16 bytes of a plane: pixels, or values
        blocks = -(-units * out.element_size() // (16 * DENSE_BLOCK))
        args = (
            np.uint64(items.data_ptr()),
            np.uint64(out.data_ptr()),
            np.int64(n * h * w),
            np.int32(h * w),
            np.int32(chw),
            *a,
            *b,
        )
        _launch(self.gpu, self.dense, (blocks,), DENSE_BLOCK, args)
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
