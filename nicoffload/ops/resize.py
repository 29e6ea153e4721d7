"""resize: uint8 HWC image -> resized image (shorter side, longer side, or exact size).

Bilinear with antialias semantics of PIL and torchvision's `antialias=True` (the triangle filter
widened by the scale factor when shrinking). The output size follows torchvision's `Resize`.
"""

from __future__ import annotations

from nicoffload.graph import Dim, TensorSpec
from nicoffload.ops import Param, ParamError, WiringError, op


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
