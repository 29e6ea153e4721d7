"""The one contract every registered kernel meets, whatever its op(s) and device.

`check_kernel(kernel)` builds the kernel's chain for each parameter case, feeds it fresh random
valid inputs, and checks: the result's dtype and shape are what the ops' `infer` says; its values
match the CPU reference of the ops (float64 numpy; Pillow for decode and resize) within the
tolerance stated below for the chain's last op; the input is left untouched; and, where the
output shape is static, `out` is poisoned twice with different bytes before the call, must be
returned, and must come back equal to the `out=None` result (so every element was written).
GPU kernels are called through their batch convention (see nicoffload/ops/gpu_image.py).

NICOFFLOAD_CONTRACT=small (set by `make test-arm`, where the kernels run emulated and the point is
the instruction set, not the sizes): the same cases at about a quarter of the pixel sizes.
"""

from __future__ import annotations

import io
import math
import os
import zlib
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from nicoffload.errors import Mark
from nicoffload.graph import Dim, Node, Ref, TensorSpec
from nicoffload.ops import Kernel, ParamError, WiringError, get_op
from nicoffload.ops.crop import crop_box
from nicoffload.ops.normalize import affine
from nicoffload.ops.resize import output_size
from nicoffload.ops.tokenize import load_tokenizer


@dataclass(frozen=True)
class Tolerance:
    """|kernel - reference| <= max_abs + rtol * |reference| per element, mean <= mean_abs."""

    max_abs: float
    rtol: float = 0.0
    mean_abs: float = math.inf
    why: str = ""


EXACT = Tolerance(0, why="integer ops computed exactly")
FLOAT = {
    "float32": Tolerance(1e-5, 2.0**-22, why="float64 result rounded to float32, plus fp32 math"),
    "float16": Tolerance(1e-5, 2.0**-11, why="float64 result rounded once to float16"),
}
TOLERANCES = {
    # Pillow decodes with libjpeg-turbo too: RGB is bit-exact. Gray output of a color JPEG is
    # libjpeg's coded luma (Y); Pillow recomputes L from clipped RGB: <= 9 levels measured.
    ("decode_image", "rgb"): EXACT,
    ("decode_image", "gray"): Tolerance(12, mean_abs=0.2, why="coded Y vs Pillow's L of RGB"),
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's (tests/device measures 0.3-3.5).
    # measured on the H200: 0.03-2.15 uint8 levels on photographs, 4.2 on this contract's own
    # synthetic images (noise on upsampled random blocks, random chroma subsampling)
    ("decode_image", "gpu"): Tolerance(
        math.inf, mean_abs=6.0, why="nvJPEG vs libjpeg-turbo: IDCT, chroma upsampling"
    ),
    ("resize", ""): Tolerance(1, why="Pillow's arithmetic, passes in the other order"),
    ("center_crop", ""): EXACT,
    ("tokenize", ""): EXACT,
}

# Parameter cases; case i of a chain takes case i (cyclically) of every op in it.
CASES = {
    "decode_image": [{"color": "rgb"}, {"color": "gray"}, {"color": "rgb", "dct_scaling": False}],
    "resize": [
        {"shorter": 64},
        {"size": [40, 56]},
        {"longer": 150, "antialias": False},
        {"shorter": 300},
    ],
    "center_crop": [{"size": [48, 40]}, {"size": 96}, {"size": [20, 400]}],
    "normalize": [
        {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "dtype": "float16"},
        {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.3, 0.4], "layout": "hwc"},
        {"mean": [0.5], "std": [0.25], "dtype": "float16", "layout": "hwc"},
    ],
    "tokenize": [{"max_length": 32}, {"max_length": 128, "dtype": "int32"}],
}
MAX_SIDE, MAX_ENCODED_SIDE = 200, 160  # random images: 1..MAX_SIDE px a side
SMALL = os.environ.get("NICOFFLOAD_CONTRACT") == "small"
if SMALL:  # images and sizes scaled together: each case still shrinks (antialiased), enlarges,
    # crops inside and pads, with both odd and vector-width rows
    MAX_SIDE, MAX_ENCODED_SIDE = 48, 48
    CASES["resize"] = [
        {"shorter": 16},
        {"size": [10, 14]},
        {"longer": 38, "antialias": False},
        {"shorter": 75},
    ]
    CASES["center_crop"] = [{"size": [12, 10]}, {"size": 24}, {"size": [5, 100]}]
MARK = Mark("<kernel_contract>", 1, 1)


def make_chain(ops: tuple[str, ...], raws: list[dict], in_spec: TensorSpec) -> list[Node]:
    """Nodes for a chain of ops, each reading the previous one, with validated parameters."""
    nodes, spec, source = [], in_spec, Ref("input", "in", is_input=True)
    for i, (name, raw) in enumerate(zip(ops, raws, strict=True)):
        opdef = get_op(name)
        assert opdef is not None, f"unknown op {name}"
        params = opdef.bind(raw)
        outs = opdef.infer(params, (spec,))
        nodes.append(Node(f"n{i}_{name}", name, params, (source,), (spec,), outs, MARK))
        spec, source = next(iter(outs.values())), Ref(f"n{i}_{name}")
    return nodes


def _smooth_image(rng: np.random.Generator, h: int, w: int, c: int) -> np.ndarray:
    small = rng.integers(0, 256, (max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), np.int16)
    img = np.clip(img + rng.integers(-8, 9, img.shape), 0, 255).astype(np.uint8)
    return img[..., :1] if c == 1 else img


def _encoded(rng: np.random.Generator) -> bytes:
    side = MAX_ENCODED_SIDE
    img = _smooth_image(rng, int(rng.integers(8, side)), int(rng.integers(8, side)), 3)
    kind = rng.choice(["jpeg", "jpeg", "progressive", "gray-jpeg", "png", "rgba-png", "p-png"])
    buf = io.BytesIO()
    pil = Image.fromarray(img)
    if kind == "png":
        pil.save(buf, "PNG")
    elif kind == "rgba-png":
        pil.convert("RGBA").save(buf, "PNG")
    elif kind == "p-png":
        pil.convert("P", palette=Image.ADAPTIVE).save(buf, "PNG")
    else:
        pil = pil.convert("L") if kind == "gray-jpeg" else pil
        sub = int(rng.integers(0, 3))
        quality = int(rng.integers(60, 100))
        pil.save(buf, "JPEG", quality=quality, subsampling=sub, progressive=kind == "progressive")
    return buf.getvalue()


def make_input(first_op: str, c: int, rng: np.random.Generator, float_input: bool = False):
    """A fresh random valid input for a chain's first op (c channels), and its (static) spec."""
    if first_op == "decode_image":
        data = _encoded(rng)
        return data, TensorSpec("bytes", (Dim("nbytes", len(data)),))
    if first_op == "tokenize":
        from nicoffload.samples import sample_text

        text = sample_text(int(rng.integers(1 << 30)), seed=int(rng.integers(1 << 30)))[1]
        return text, TensorSpec("str", (Dim("nchars", len(text)),))
    h, w = int(rng.integers(1, MAX_SIDE)), int(rng.integers(1, MAX_SIDE))
    img = _smooth_image(rng, h + 3, w + 2, c)[2 : h + 2, 1 : w + 1]  # a strided view
    if float_input:
        img = (img.astype(np.float32) + rng.random(img.shape, np.float32)) / 2
    return img, TensorSpec(str(img.dtype), (h, w, c), layout="hwc")


def reference(node: Node, x):
    """The op's meaning, computed plainly: float64 numpy, or Pillow."""
    p = node.params
    if node.op == "decode_image":
        with Image.open(io.BytesIO(x)) as im:
            if im.mode.startswith("I"):  # 16-bit gray: we define 8-bit as >> 8
                px = (np.asarray(im).astype(np.uint32) >> 8).astype(np.uint8)
                px = np.stack([px] * 3, -1) if p["color"] == "rgb" else px
            else:
                px = np.asarray(im.convert("RGB" if p["color"] == "rgb" else "L"))
        return px if px.ndim == 3 else px[..., None]
    if node.op == "resize":
        h, w, c = x.shape
        oh, ow = output_size(p, h, w)
        if not p["antialias"]:
            return _bilinear_no_aa(x, oh, ow)
        planes = [Image.fromarray(np.ascontiguousarray(x[..., i])) for i in range(c)]
        return np.stack([np.asarray(q.resize((ow, oh), Image.BILINEAR)) for q in planes], -1)
    if node.op == "center_crop":
        (h, w, c), (ch, cw) = x.shape, p["size"]
        top, left = crop_box(h, w, ch, cw)
        out = np.zeros((ch, cw, c), x.dtype)
        t0, l0, t1, l1 = max(top, 0), max(left, 0), min(top + ch, h), min(left + cw, w)
        out[t0 - top : t1 - top, l0 - left : l1 - left] = x[t0:t1, l0:l1]
        return out
    if node.op == "normalize":
        a, b = (np.asarray(v, np.float64) for v in affine(p))
        out = x.astype(np.float64) * a + b
        return out.transpose(2, 0, 1) if p["layout"] == "chw" else out
    if node.op == "tokenize":
        enc = load_tokenizer(p).encode(x, add_special_tokens=p["add_special_tokens"])
        return np.array(enc.ids), np.array(enc.attention_mask)
    raise NotImplementedError(f"no reference for op '{node.op}': add one to {__file__}")


def _bilinear_no_aa(x: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """Triangle filter of support 1 at Pillow's sample positions, float64, per axis."""

    def weights(n_in: int, n_out: int) -> np.ndarray:
        scale = n_in / n_out
        center = (np.arange(n_out) + 0.5) * scale
        taps = np.arange(n_in)[None, :] + 0.5 - center[:, None]
        wts = np.clip(1 - np.abs(taps), 0, None)
        return wts / wts.sum(1, keepdims=True)

    def to_u8(v: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(v + 0.5), 0, 255)

    tmp = to_u8(np.einsum("ow,hwc->hoc", weights(x.shape[1], ow), x.astype(np.float64)))
    return to_u8(np.einsum("oh,hwc->owc", weights(x.shape[0], oh), tmp)).astype(np.uint8)


def _op_tolerance(kernel: Kernel, node: Node) -> Tolerance:
    if node.op == "normalize":
        return FLOAT[node.params["dtype"]]
    if node.op == "decode_image":
        key = "gpu" if kernel.device == "gpu" else node.params["color"]
        return TOLERANCES[("decode_image", key)]
    return TOLERANCES[(node.op, "")]


def tolerance(kernel: Kernel, nodes: list[Node]) -> Tolerance:
    """The last op's tolerance, widened by what the ops before it may be off (in its units)."""
    last = _op_tolerance(kernel, nodes[-1])
    upstream = sum(_op_tolerance(kernel, n).max_abs for n in nodes[:-1])
    if nodes[-1].op == "normalize":
        upstream *= max(abs(a) for a in affine(nodes[-1].params)[0])
    return replace(last, max_abs=last.max_abs + upstream)


def assert_close(got: np.ndarray, want: np.ndarray, tol: Tolerance, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.isfinite(diff).all(), f"{what}: non-finite values (unwritten output?)"
    excess = diff - (tol.max_abs + tol.rtol * np.abs(want.astype(np.float64)))
    assert excess.max(initial=0) <= 0, (
        f"{what}: off by {diff.max()} at {np.unravel_index(excess.argmax(), excess.shape)} "
        f"(allowed {tol.max_abs} + {tol.rtol}*|ref|: {tol.why})"
    )
    assert diff.mean() <= tol.mean_abs, f"{what}: mean abs {diff.mean():.3f} > {tol.mean_abs}"


def _check_spec(got: np.ndarray, spec: TensorSpec, what: str) -> None:
    assert str(got.dtype) == spec.dtype, f"{what}: dtype {got.dtype}, infer says {spec.dtype}"
    assert got.ndim == len(spec.shape), f"{what}: shape {got.shape}, infer says {spec}"
    for have, dim in zip(got.shape, spec.shape, strict=True):
        assert not isinstance(dim, int) or have == dim, f"{what}: shape {got.shape} vs {spec}"


def check_kernel(kernel: Kernel, seed: int = 0, float_input: bool = False) -> int:
    """Run `kernel` on fresh inputs for every parameter case; returns how many cases ran."""
    ops, ran = kernel.ops, 0
    for case in range(max(len(CASES[op]) for op in ops)):
        rng = np.random.default_rng([seed, case, zlib.crc32("+".join(ops).encode())])
        raws = [CASES[op][case % len(CASES[op])] for op in ops]
        mean = next((r["mean"] for op, r in zip(ops, raws, strict=True) if op == "normalize"), None)
        c = len(mean) if mean else int(rng.choice([1, 3]))
        x, spec = make_input(ops[0], c, rng, float_input)
        try:
            nodes = make_chain(ops, raws, spec)
        except (ParamError, WiringError):
            continue  # these cases do not fit together (a gray decode before 3-channel means)
        ran += 1
        what = f"{'+'.join(ops)}@{kernel.device} case {case} {raws}"
        want = x
        for node in nodes:
            want = reference(node, want)
        wants = want if isinstance(want, tuple) else (want,)
        specs = list(nodes[-1].out_specs.values())
        fn = kernel.build(nodes, ())
        before = x.copy() if isinstance(x, np.ndarray) else x
        got = [np.array(g) for g in _call(kernel, fn, x, None)]
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, before), f"{what}: the kernel modified its input"
        for g, w, s in zip(got, wants, specs, strict=True):
            _check_spec(g, s, what)
            assert_close(g, w, tolerance(kernel, nodes), what)
        if all(s.static for s in specs):
            for poison in (0x00, 0xFF):
                outs = tuple(np.empty(s.shape, s.dtype) for s in specs)
                for o in outs:
                    o.view(np.uint8).fill(poison)
                back = _call(kernel, fn, x, outs)
                for g, o in zip(got, back, strict=True):
                    assert np.array_equal(np.asarray(o), g, equal_nan=True), (
                        f"{what}: with out poisoned 0x{poison:02x} some elements were not written"
                    )
    assert ran, f"no parameter case of {'+'.join(ops)} fits together"
    return ran


def _call(kernel: Kernel, fn, x, outs: tuple | None) -> tuple:
    """One item through `fn`, per-item contract on cpu/dpu, batch convention on the GPU."""
    if kernel.device != "gpu":
        res = fn(x, out=None if outs is None else (outs if len(outs) > 1 else outs[0]))
        res = res if isinstance(res, tuple) else (res,)
        if outs is not None:
            assert all(r is o for r, o in zip(res, outs, strict=True)), "out was not returned"
        return tuple(np.array(r) for r in res)
    import torch

    dev_outs = None
    if outs is not None:
        dev_outs = tuple(torch.from_numpy(o[None].copy()).cuda() for o in outs)
    item = np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x
    res = fn([item], out=None if dev_outs is None else dev_outs[0])
    res = res if isinstance(res, tuple) else (res,)
    return tuple(r[0].cpu().numpy() for r in res)
