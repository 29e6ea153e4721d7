"""resize: uint8 HWC image -> resized image (shorter side, longer side, or exact size).

Bilinear with antialias semantics of PIL and torchvision's `antialias=True` (the triangle filter
widened by the scale factor when shrinking). The output size follows torchvision's `Resize`.
The CPU/DPU kernel (numba, Pillow's fixed-point arithmetic, within one level of Pillow) is below.
"""

from __future__ import annotations

import numpy as np

from nicoffload.graph import Dim, TensorSpec
from nicoffload.ops import Param, ParamError, WiringError, kernel, op


def output_size(params: dict, h: int, w: int) -> tuple[int, int]:
    """The (height, width) an image of (h, w) is resized to; torchvision's rounding."""
    if params["size"] is not None:
        return tuple(params["size"])  # type: ignore[return-value]
    short, long = (h, w) if h <= w else (w, h)
    if params["shorter"] is not None:
        new_short, new_long = params["shorter"], int(params["shorter"] * long / short)
    else:
        new_long = params["longer"]
        new_short = max(1, int(new_long * short / long))
    return (new_short, new_long) if h <= w else (new_long, new_short)


def _check(params: dict) -> None:
    given = [k for k in ("shorter", "longer", "size") if params[k] is not None]
    if len(given) != 1:
        name = given[1] if len(given) > 1 else "shorter"
        raise ParamError(name, "give exactly one of 'shorter', 'longer' or 'size'")


def _work(params, in_specs, out_specs) -> float:
    ih, iw, _ = in_specs[0].typical_shape
    oh, ow, _ = out_specs["out"].typical_shape
    return float(ih * iw + oh * ow)


@op(
    "resize",
    params=[
        Param("shorter", "int", None, minimum=1, doc="resize so the shorter side is this long"),
        Param("longer", "int", None, minimum=1, doc="resize so the longer side is this long"),
        Param("size", "size", None, doc="exact output [height, width]"),
        Param("interpolation", "str", "bilinear", choices=("bilinear",)),
        Param("antialias", "bool", True, doc="widen the filter when shrinking (PIL's behaviour)"),
    ],
    work=_work,
    work_unit="pixels",
    check=_check,
)
def resize(params, in_specs):
    """Resize an HWC image with bilinear interpolation (antialiased when shrinking)."""
    (src,) = in_specs
    if src.dtype != "uint8" or len(src.shape) != 3 or src.layout != "hwc":
        raise WiringError(f"resize takes a uint8 HWC image, got {src}")
    th, tw = src.typical_shape[:2]
    oh, ow = output_size(params, th, tw)
    if params["size"] is None:
        shape = (Dim("Hr", oh), Dim("Wr", ow), src.shape[2])
    else:
        shape = (oh, ow, src.shape[2])
    return {"out": TensorSpec("uint8", shape, layout="hwc")}


@kernel("resize", "cpu")
def resize_cpu(nodes, consumers):
    """Pillow's resampling in numba, vertical pass first (within one level of Pillow), both
    passes vectorized; coefficient tables cached per size pair."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, warm_inputs
    from nicoffload.ops._resample import resample_window

    (node,) = nodes
    params = node.params
    antialias = params["antialias"]
    scratch = Scratch()

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        oh, ow = output_size(params, h, w)
        if out is None:
            out = scratch.get("out", (oh, ow, c))
        resample_window(x, (oh, ow), (0, oh, 0, ow), antialias, out)
        return out

    fn = contiguous_out(fn)
    for x in warm_inputs():
        fn(x)
    return fn


@kernel("resize", "dpu")
def resize_dpu(nodes, consumers):
    """The same numba kernel on the DPU's Arm cores."""
    return resize_cpu(nodes, consumers)
