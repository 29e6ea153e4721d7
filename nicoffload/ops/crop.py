"""center_crop: HWC image -> its central [height, width] window (torchvision semantics).

An image smaller than the window is padded with zeros around it, as torchvision does.
The CPU/DPU kernel (a numba copy) is below the semantics.
"""

from __future__ import annotations

import numpy as np

from nicoffload.graph import TensorSpec
from nicoffload.ops import Param, WiringError, kernel, op


def crop_box(h: int, w: int, ch: int, cw: int) -> tuple[int, int]:
    """Top and left of the window in source coordinates (negative when padding is needed)."""
    return round((h - ch) / 2.0), round((w - cw) / 2.0)


def _work(params, in_specs, out_specs) -> float:
    h, w, _c = out_specs["out"].typical_shape
    return float(h * w)


@op(
    "center_crop",
    params=[Param("size", "size", doc="output [height, width], or one integer for a square")],
    work=_work,
    work_unit="pixels",
)
def center_crop(params, in_specs):
    """Take the central window of an HWC image."""
    (src,) = in_specs
    if len(src.shape) != 3 or src.layout != "hwc" or src.dtype in ("bytes", "str"):
        raise WiringError(f"center_crop takes an HWC image, got {src}")
    ch, cw = params["size"]
    return {"out": TensorSpec(src.dtype, (ch, cw, src.shape[2]), layout="hwc")}


def bits_view(x: np.ndarray) -> np.ndarray:
    """The same memory as unsigned integers of the same width: a crop copies bits, whatever the
    dtype (numba has no float16), and zero bits are zero in every numeric dtype."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@kernel("center_crop", "cpu")
def center_crop_cpu(nodes, consumers):
    """numba copy of the window, zero padding where the image is smaller than it."""
    from nicoffload.ops._imgkern import (
        Scratch,
        contiguous_out,
        crop_copy,
        crop_window,
        fill_border,
        warm_inputs,
    )

    (node,) = nodes
    ch, cw = node.params["size"]
    scratch = Scratch()

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        if out is None:
            out = scratch.get("out", (ch, cw, c), x.dtype)
        (y0, y1, x0, x1), (dy, dx) = crop_window(h, w, ch, cw)
        src, dst = bits_view(x), bits_view(out)
        zero = np.zeros(c, dst.dtype)
        fill_border(dst, zero, dy, dy + y1 - y0, dx, dx + x1 - x0, False)
        crop_copy(src, y0, x0, dst, dy, dx, y1 - y0, x1 - x0)
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs(dtype=node.in_specs[0].dtype):
        fn(x)
    return fn


@kernel("center_crop", "dpu")
def center_crop_dpu(nodes, consumers):
    """The same numba kernel on the DPU's Arm cores."""
    return center_crop_cpu(nodes, consumers)
