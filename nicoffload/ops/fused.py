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


@kernel(("resize", "center_crop", "normalize"), "cpu")
def resize_crop_normalize_cpu(nodes, consumers):
    """One pass: only the cropped pixels are resampled, normalized by table into `out`."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, fill_border, warm_inputs
    from nicoffload.ops._resample import resample_window
    from nicoffload.ops.normalize import Normalizer

    resize, crop, norm_node = nodes
    norm = Normalizer(norm_node.params, "uint8")
    antialias = resize.params["antialias"]
    pad = norm.pad_value()
    scratch = Scratch()

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        oh, ow = output_size(resize.params, h, w)
        (ch, cw), window, offset, inner = _crop_geometry(crop, oh, ow)
        if out is None:
            out = scratch.get("out", norm.shape(ch, cw, c), norm.dtype)
        dst = out.view(np.uint16) if out.dtype == np.float16 else out
        fill_border(dst, pad, *inner, norm.chw)
        resample_window(x, (oh, ow), window, antialias, dst, offset, norm.lut, norm.chw)
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs(len(norm_node.params["mean"])):
        fn(x)
    return fn


@kernel(("resize", "center_crop"), "cpu")
def resize_crop_cpu(nodes, consumers):
    """One pass: only the cropped pixels are resampled, straight into `out`."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, fill_border, warm_inputs
    from nicoffload.ops._resample import resample_window

    resize, crop = nodes
    antialias = resize.params["antialias"]
    scratch = Scratch()

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        oh, ow = output_size(resize.params, h, w)
        (ch, cw), window, offset, inner = _crop_geometry(crop, oh, ow)
        if out is None:
            out = scratch.get("out", (ch, cw, c))
        fill_border(out, np.zeros(c, np.uint8), *inner, False)
        resample_window(x, (oh, ow), window, antialias, out, offset)
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

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        (ch, cw), window, offset, inner = _crop_geometry(crop, h, w)
        if out is None:
            out = scratch.get("out", norm.shape(ch, cw, c), norm.dtype)
        dst = out.view(np.uint16) if out.dtype == np.float16 else out
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
