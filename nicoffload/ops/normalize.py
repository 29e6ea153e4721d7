"""normalize: uint8 HWC image -> (x * scale - mean) / std as float32/float16, HWC or CHW.

The CPU/DPU kernel (a float64-exact lookup table per channel, in numba) is below the semantics.
"""

from __future__ import annotations

import numpy as np

from nicoffload.graph import TensorSpec
from nicoffload.ops import Param, ParamError, WiringError, kernel, op


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


class Normalizer:
    """normalize's arithmetic for the kernels: a uint8 -> dtype table, or float32 a and b."""

    def __init__(self, params: dict, in_dtype: str) -> None:
        from nicoffload.ops._imgkern import norm_lut

        a, b = affine(params)
        self.a, self.b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        self.dtype = np.dtype(params["dtype"])
        self.chw = params["layout"] == "chw"
        self.lut = norm_lut(a, b, params["dtype"]) if in_dtype == "uint8" else None

    def shape(self, h: int, w: int, c: int) -> tuple[int, int, int]:
        return (c, h, w) if self.chw else (h, w, c)

    def pad_value(self) -> np.ndarray:
        """What a zero pixel (a center crop's padding) normalizes to, as the kernel writes it."""
        from nicoffload.ops._imgkern import as_numba_dst

        if self.lut is not None:
            return np.ascontiguousarray(self.lut[:, 0])
        return as_numba_dst(self.b.astype(self.dtype))

    def apply(self, src, window, dst, offset, scratch) -> None:
        """dst[offset window] = normalize(src[window]); window = (y0, y1, x0, x1)."""
        from nicoffload.ops._imgkern import as_numba_dst, crop_affine, crop_lut

        y0, y1, x0, x1 = window
        dy, dx = offset
        if self.lut is not None:
            crop_lut(src, y0, x0, self.lut, as_numba_dst(dst), dy, dx, y1 - y0, x1 - x0, self.chw)
        elif dst.dtype == np.float32:
            crop_affine(src, y0, x0, self.a, self.b, dst, dy, dx, y1 - y0, x1 - x0, self.chw)
        else:  # float input, float16 output: numba has no float16, numpy casts (GIL released)
            h, w, c = y1 - y0, x1 - x0, src.shape[2]
            tmp = scratch.get("norm_f32", self.shape(h, w, c), np.float32)
            crop_affine(src, y0, x0, self.a, self.b, tmp, 0, 0, h, w, self.chw)
            rows, cols = slice(dy, dy + h), slice(dx, dx + w)
            dst[(slice(None), rows, cols) if self.chw else (rows, cols)] = tmp


@kernel("normalize", "cpu")
def normalize_cpu(nodes, consumers):
    """uint8 input: a per-channel 256-entry table computed in float64 at build time (exactly
    rounded, one lookup per value); float32 input: x * a + b in numba."""
    from nicoffload.ops._imgkern import Scratch, contiguous_out, warm_inputs

    (node,) = nodes
    norm = Normalizer(node.params, node.in_specs[0].dtype)
    scratch = Scratch()

    def fn(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        h, w, c = x.shape
        if out is None:
            out = scratch.get("out", norm.shape(h, w, c), norm.dtype)
        norm.apply(x, (0, h, 0, w), out, (0, 0), scratch)
        return out

    c = len(node.params["mean"])
    fn = contiguous_out(fn)
    for x in warm_inputs(c, node.in_specs[0].dtype):
        fn(x)
    return fn


@kernel("normalize", "dpu")
def normalize_dpu(nodes, consumers):
    """The same numba kernel on the DPU's Arm cores."""
    return normalize_cpu(nodes, consumers)
