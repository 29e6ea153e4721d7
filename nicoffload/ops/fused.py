"""Fused kernels: chains of ops computed in one pass (registered per device).

resize + center_crop (+ normalize) resamples only the output pixels inside the crop: the passes
run over just the output rows and columns of the window and the source columns they need, and
each result goes straight into `out` (through normalize's table when fused), already in the
output layout; the padding, if any, is filled directly. Results equal the unfused chain exactly.
"""

from __future__ import annotations

import numpy as np

from nicoffload.ops import kernel
from nicoffload.ops.resize import output_size


def _crop_geometry(node, h: int, w: int):
    from nicoffload.ops._imgkern import crop_window

    ch, cw = node.params["size"]
    window, offset = crop_window(h, w, ch, cw)
    y0, y1, x0, x1 = window
    inner = (offset[0], offset[0] + y1 - y0, offset[1], offset[1] + x1 - x0)
    return (ch, cw), window, offset, inner


GEOMETRY_SIZES = 4096  # source sizes remembered per kernel (a dataset has few)


class _Geometry:
    """Per source size (h, w): the crop's size, window, offset and inner rectangle, whether it
    pads, and with a resize `resample`'s arguments up to its lut (the coefficient tables and
    the window); worked out once per size, not per item (the Python calls of that were most of
    these kernels' GIL-held time)."""

    def __init__(self, resize, crop) -> None:
        self._resize, self._crop = resize, crop
        self._memo: dict[tuple[int, int], tuple] = {}

    def __call__(self, h: int, w: int) -> tuple:
        got = self._memo.get((h, w))
        if got is None:
            got = self._work_out(h, w)
            if len(self._memo) >= GEOMETRY_SIZES:
                self._memo.clear()
            self._memo[h, w] = got
        return got

    def _work_out(self, h: int, w: int) -> tuple:
        from nicoffload.ops._resample import tables

        resize = self._resize
        oh, ow = output_size(resize.params, h, w) if resize else (h, w)
        (ch, cw), window, offset, inner = _crop_geometry(self._crop, oh, ow)
        pads = inner != (0, ch, 0, cw)  # else fill_border would write nothing
        head = ()
        if resize:
            head = (*tables(h, w, (oh, ow), resize.params["antialias"]), *window)
        return (ch, cw), window, offset, inner, pads, head


@kernel(("resize", "center_crop", "normalize"), "cpu")
def resize_crop_normalize_cpu(nodes, consumers):
    """One pass: only the cropped pixels are resampled, normalized by table into `out`."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, fill_border, warm_inputs
    from nicoffload.ops._resample import lut_mode, resample
    from nicoffload.ops.normalize import Normalizer

    resize, crop, norm_node = nodes
    norm = Normalizer(norm_node.params, "uint8")
    lut, mode = lut_mode(norm.lut, norm.chw)
    pad = norm.pad_value()
    scratch = Scratch()
    geometry = _Geometry(resize, crop)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        (ch, cw), _, (dy, dx), inner, pads, head = geometry(h, w)
        if out is None:
            out = scratch.get("out", norm.shape(ch, cw, c), norm.dtype)
        dst = out.view(np.uint16) if out.dtype == np.float16 else out
        if pads:
            fill_border(dst, pad, *inner, norm.chw)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        resample(x, *head, lut, dst, dy, dx, mode)  # resample_window, its tables kept per size
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs(len(norm_node.params["mean"])):
        fn(x)
    return fn


@kernel(("resize", "center_crop"), "cpu")
def resize_crop_cpu(nodes, consumers):
    """One pass: only the cropped pixels are resampled, straight into `out`."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, fill_border, warm_inputs
    from nicoffload.ops._resample import lut_mode, resample

    resize, crop = nodes
    lut, mode = lut_mode(None, False)
    scratch = Scratch()
    geometry = _Geometry(resize, crop)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        (ch, cw), _, (dy, dx), inner, pads, head = geometry(h, w)
        if out is None:
            out = scratch.get("out", (ch, cw, c))
        if pads:
            fill_border(out, np.zeros(c, np.uint8), *inner, False)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        resample(x, *head, lut, out, dy, dx, mode)  # resample_window, its tables kept per size
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs():
        fn(x)
    return fn


@kernel(("center_crop", "normalize"), "cpu")
def crop_normalize_cpu(nodes, consumers):
    """The crop window normalized straight into `out`; padding is normalize(0)."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, fill_border, warm_inputs
    from nicoffload.ops.normalize import Normalizer

    crop, norm_node = nodes
    in_dtype = crop.in_specs[0].dtype
    norm = Normalizer(norm_node.params, in_dtype)
    pad = norm.pad_value()
    scratch = Scratch()
    geometry = _Geometry(None, crop)

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        (ch, cw), window, offset, inner, pads, _ = geometry(h, w)
        if out is None:
            out = scratch.get("out", norm.shape(ch, cw, c), norm.dtype)
        dst = out.view(np.uint16) if out.dtype == np.float16 else out
        if pads:
            fill_border(dst, pad, *inner, norm.chw)
        norm.apply(x, window, out, offset, scratch)
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs(len(norm_node.params["mean"]), in_dtype):
        fn(x)
    return fn


# The DPU agent runs the same numba kernels on its Arm cores.
for _chain, _build in (
    (("resize", "center_crop", "normalize"), resize_crop_normalize_cpu),
    (("resize", "center_crop"), resize_crop_cpu),
    (("center_crop", "normalize"), crop_normalize_cpu),
):
    kernel(_chain, "dpu")(_build)
