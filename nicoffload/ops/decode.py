"""decode_image: JPEG/PNG bytes -> uint8 HWC (RGB or gray).

Semantics here; the CPU kernel (libjpeg-turbo through simplejpeg, with DCT-domain downscaling
when a downstream resize lets it decode smaller) is below them.
"""

from __future__ import annotations

from nicoffload.graph import Dim, TensorSpec
from nicoffload.ops import Param, WiringError, op

DEFAULT_MAX_PIXELS = 40_000_000


def _work(params, in_specs, out_specs) -> float:
    h, w, _ = out_specs["out"].typical_shape
    return float(h * w)


@op(
    "decode_image",
    params=[
        Param(
            "color",
            "str",
            "rgb",
            choices=("rgb", "gray"),
            doc="output channels: rgb (3) or gray (1)",
        ),
        Param(
            "max_pixels",
            "int",
            DEFAULT_MAX_PIXELS,
            minimum=1,
            doc="reject larger images (decompression bombs)",
        ),
        Param(
            "dct_scaling",
            "bool",
            True,
            doc="decode smaller in the DCT domain when a downstream resize allows",
        ),
        Param(
            "fast",
            "bool",
            False,
            doc="libjpeg-turbo's fast IDCT and upsampling (slightly less exact)",
        ),
    ],
    work=_work,
    work_unit="pixels",
)
def decode_image(params, in_specs):
    """Decode a JPEG (baseline/progressive, any subsampling, gray, CMYK) or PNG into uint8 HWC."""
    (src,) = in_specs
    if src.dtype != "bytes":
        raise WiringError(f"decode_image reads encoded bytes, got {src}")
    channels = 3 if params["color"] == "rgb" else 1
    shape = (Dim("H", src.hint("height", 375)), Dim("W", src.hint("width", 500)), channels)
    return {"out": TensorSpec("uint8", shape, layout="hwc")}
