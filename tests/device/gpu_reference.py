"""The float64 / Pillow reference of the image ops' semantics, for the GPU parity tests.

Resize is defined as Pillow's `Image.resize(BILINEAR)` (what the CPU kernels reproduce bit for
bit); center crop pads with zeros; normalize is x * a + b from `normalize.affine`, in float64.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from nicoffload.ops.crop import crop_box
from nicoffload.ops.normalize import affine
from nicoffload.ops.resize import output_size


def resize(img: np.ndarray, params: dict) -> np.ndarray:
    h, w, c = img.shape
    rh, rw = output_size(params, h, w)
    pil = Image.fromarray(img[..., 0] if c == 1 else img)
    out = np.asarray(pil.resize((rw, rh), Image.BILINEAR))
    return out.reshape(rh, rw, c)


def center_crop(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w, c = img.shape
    ch, cw = size
    top, left = crop_box(h, w, ch, cw)
    out = np.zeros((ch, cw, c), img.dtype)
    t0, l0, t1, l1 = max(top, 0), max(left, 0), min(top + ch, h), min(left + cw, w)
    out[t0 - top : t1 - top, l0 - left : l1 - left] = img[t0:t1, l0:l1]
    return out


def normalize(img: np.ndarray, params: dict) -> np.ndarray:
    a, b = (np.array(v, np.float64) for v in affine(params))
    out = img.astype(np.float64) * a + b
    return out.transpose(2, 0, 1) if params["layout"] == "chw" else out


def decode(data: bytes, color: str = "rgb") -> np.ndarray:
    """libjpeg-turbo through Pillow: the CPU decoder's output."""
    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im.convert("L" if color == "gray" else "RGB"))
    return arr[..., None] if arr.ndim == 2 else arr


def assert_close_to_dtype(out: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    """Within rounding to `dtype` once (half an ulp), plus float32 arithmetic's error."""
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "non-finite values (unwritten output?)"
    rtol = 2.0**-11 if dtype == "float16" else 2.0**-23
    bound = rtol * np.abs(ref) + 1e-5
    worst = np.max(np.abs(out - ref) - bound)
    assert worst <= 0, f"exceeds {dtype} rounding by {worst:.3g}"


def _table(in_size: int, out_size: int, antialias: bool) -> np.ndarray:
    """Pillow's fixed-point weights as a dense (out, in) matrix, same double arithmetic."""
    scale = in_size / out_size
    filterscale = scale if (antialias and scale > 1.0) else 1.0
    support = 1.0 * filterscale
    ss = 1.0 / filterscale
    table = np.zeros((out_size, in_size), np.int64)
    for o in range(out_size):
        center = (o + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        ws = [max(0.0, 1.0 - abs((x + xmin - center + 0.5) * ss)) for x in range(xmax)]
        total = sum(ws)
        for x, w in enumerate(ws):
            k = w / total if total != 0.0 else w
            table[o, xmin + x] = int(k * (1 << 22) + (0.5 if k >= 0 else -0.5))
    return table


def resize_fixed_point(img: np.ndarray, rh: int, rw: int, antialias: bool) -> np.ndarray:
    """The resampling written out in numpy: horizontal pass, uint8 rounding, vertical pass."""

    def clip8(acc: np.ndarray) -> np.ndarray:
        return np.clip((acc + (1 << 21)) >> 22, 0, 255)

    h, w, _ = img.shape
    tmp = clip8(np.einsum("ow,hwc->hoc", _table(w, rw, antialias), img.astype(np.int64)))
    return clip8(np.einsum("oh,hwc->owc", _table(h, rh, antialias), tmp)).astype(np.uint8)


def write_pipeline(tmp_path: Path, nodes: str, output: str, name: str = "p") -> Path:
    """A one-input JPEG pipeline file with the given node lines (YAML flow mappings)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"""
name: {name}
inputs: {{image: {{kind: bytes, format: jpeg}}}}
nodes:
{nodes}
outputs: {{out: {output}}}
batch: {{max_size: 16, max_wait_ms: 2}}
"""
    )
    return path
