"""center_crop: HWC image -> its central [height, width] window (torchvision semantics).

An image smaller than the window is padded with zeros around it, as torchvision does.
"""

from __future__ import annotations

from nicoffload.graph import TensorSpec
from nicoffload.ops import Param, WiringError, op


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
