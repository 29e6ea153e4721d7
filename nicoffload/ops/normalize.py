"""normalize: uint8 HWC image -> (x * scale - mean) / std as float32/float16, HWC or CHW."""

from __future__ import annotations

from nicoffload.graph import TensorSpec
from nicoffload.ops import Param, ParamError, WiringError, op


def affine(params: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (a, b) with out = x * a + b: the form every kernel computes."""
    scale = params["scale"]
    a = tuple(scale / s for s in params["std"])
    b = tuple(-m / s for m, s in zip(params["mean"], params["std"], strict=True))
    return a, b


def _check(params: dict) -> None:
    if len(params["mean"]) != len(params["std"]):
        raise ParamError(
            "std", f"'mean' has {len(params['mean'])} values but 'std' has {len(params['std'])}"
        )
    if any(s == 0 for s in params["std"]):
        raise ParamError("std", "'std' values must be non-zero")


def _work(params, in_specs, out_specs) -> float:
    h, w, _ = in_specs[0].typical_shape
    return float(h * w)


@op(
    "normalize",
    params=[
        Param("mean", "floats", doc="per-channel mean, in units of x * scale"),
        Param("std", "floats", doc="per-channel standard deviation"),
        Param(
            "scale", "float", 1 / 255, doc="multiplies the input first (1/255 maps uint8 to [0, 1])"
        ),
        Param("dtype", "str", "float32", choices=("float32", "float16")),
        Param("layout", "str", "chw", choices=("chw", "hwc")),
    ],
    work=_work,
    work_unit="pixels",
    check=_check,
)
def normalize(params, in_specs):
    """Scale, subtract the mean and divide by the std per channel; optionally transpose to CHW."""
    (src,) = in_specs
    if len(src.shape) != 3 or src.layout != "hwc" or src.dtype not in ("uint8", "float32"):
        raise WiringError(f"normalize takes a uint8 or float32 HWC image, got {src}")
    c = src.shape[2]
    if isinstance(c, int) and c != len(params["mean"]):
        raise ParamError(
            "mean", f"'mean' has {len(params['mean'])} values for an image of {c} channel(s)"
        )
    h, w = src.shape[:2]
    shape = (c, h, w) if params["layout"] == "chw" else (h, w, c)
    return {"out": TensorSpec(params["dtype"], shape, layout=params["layout"])}
