"""decode_image: JPEG/PNG bytes -> uint8 HWC (RGB or gray).

Semantics here; the CPU/DPU kernel below them: libjpeg-turbo through simplejpeg for JPEG, into
per-thread buffers, decoding smaller in the DCT domain when the consumers are antialiased
resizes that leave room for it (`decoded_size`, which the planner prices with too); Pillow for PNG. The format comes from the magic
bytes, never a file name. Every failure is an ItemError with a stable reason: empty, truncated,
corrupt, unsupported_format, too_large (from the header, before any pixel is decoded).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.graph import Dim, TensorSpec
from nicoffload.ops import Alloc, Param, WiringError, kernel, op

DEFAULT_MAX_PIXELS = 40_000_000


def _work(params, in_specs, out_specs) -> float:
    h, w, _ = out_specs["out"].typical_shape
    return float(h * w)


def _encoded(params, in_specs, out_specs) -> float:
    """The file's bytes: libjpeg-turbo's entropy decoding reads every one (at any DCT scale),
    and at one pixel count decode time grows with them (about 10x from a flat image to a
    noisy one at quality 95, 500x375)."""
    return float(in_specs[0].typical_nbytes)


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
    encoded=_encoded,
)
def decode_image(params, in_specs):
    """Decode a JPEG (baseline/progressive, any subsampling, gray, CMYK) or PNG into uint8 HWC."""
    (src,) = in_specs
    if src.dtype != "bytes":
        raise WiringError(f"decode_image reads encoded bytes, got {src}")
    channels = 3 if params["color"] == "rgb" else 1
    shape = (Dim("H", src.hint("height", 375)), Dim("W", src.hint("width", 500)), channels)
    return {"out": TensorSpec("uint8", shape, layout="hwc")}


# --- CPU / DPU kernel ------------------------------------------------------------------------

# Magic bytes -> format; only jpeg and png are decoded, the rest are named in the error.
_SIGNATURES = (
    (0, b"\xff\xd8\xff", "jpeg"),
    (0, b"\x89PNG\r\n\x1a\n", "png"),
    (0, b"GIF87a", "gif"),
    (0, b"GIF89a", "gif"),
    (0, b"BM", "bmp"),
    (0, b"II*\x00", "tiff"),
    (0, b"MM\x00*", "tiff"),
    (8, b"WEBP", "webp"),
    (4, b"ftyp", "heif/avif"),
    (0, b"\x00\x00\x00\x0cjP  ", "jpeg2000"),
    (0, b"\xffO\xffQ", "jpeg2000"),
    (0, b"\x00\x00\x01\x00", "ico"),
    (0, b"%PDF", "pdf"),
)
# DCT scaling uses libjpeg-turbo's reduced IDCTs (1/8, 1/4, 1/2): its 5/8..7/8 IDCTs have no
# SIMD and decode slower than full size (3/8 barely faster), measured. Only exact scales, so the
# decoded image covers exactly the original field of view and the resize's target is unchanged.
DCT_SCALES = (1, 2, 4)
# A DCT-scaled decode must still leave the resize this much shrinking to do: below ~3x the
# two-stage result drifts past the accuracy bound (p99.9 0.12 at 2x, 0.07 at 3x; like PIL's
# `reducing_gap=3`, "indistinguishable from fair resampling"). Measured in test_image_accuracy.
DCT_MARGIN = 3.0


def sniff(head: bytes) -> str | None:
    """The format named by the first bytes (never the file name), or None."""
    for offset, magic, name in _SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return name
    return None


def dct_scale(h: int, w: int, target: tuple[int, int], margin: float = DCT_MARGIN) -> int:
    """The libjpeg scale numerator M (decode at M/8) for an (h, w) JPEG resized to `target`:
    the smallest exact one whose output is still `margin` times the target, else 8 (full)."""
    th, tw = target
    for m in DCT_SCALES:
        exact = (h * m) % 8 == 0 and (w * m) % 8 == 0
        if exact and h * m >= margin * 8 * th and w * m >= margin * 8 * tw:
            return m
    return 8


def scaling_rule(params: Mapping, consumers: Sequence) -> list[dict] | None:
    """The resize params DCT scaling may serve, or None when the decode must be full size.

    Only when every consumer is an antialiased resize: anything else may need full detail.
    """
    if not params["dct_scaling"] or not consumers:
        return None
    if any(c.op != "resize" or not c.params["antialias"] for c in consumers):
        return None
    return [c.params for c in consumers]


# The device kinds whose decode_image kernel is the one below (DCT-scaled); the GPU's nvJPEG
# decoder (gpu_decode.py) always decodes at full size.
DCT_SCALING_KINDS = frozenset({"cpu", "dpu"})


def decoded_size(params: Mapping, consumers: Sequence, h: int, w: int) -> tuple[int, int]:
    """The (height, width) this file's kernel decodes an h x w JPEG to, before its `consumers`
    (Nodes: op, params) read it: DCT-scaled by `dct_scale` to the largest target of the resizes
    when `scaling_rule` allows, else (h, w). The one place this is decided: the kernel asks it
    once per image size, the planner's cost model at the typical size, so the two cannot
    disagree."""
    from nicoffload.ops.resize import output_size

    rule = scaling_rule(params, consumers)
    if rule is None:
        return h, w
    targets = [output_size(r, h, w) for r in rule]
    m = dct_scale(h, w, (max(t[0] for t in targets), max(t[1] for t in targets)))
    return h * m // 8, w * m // 8  # exact: dct_scale only picks exact scales


def image_header(data) -> tuple[str, int, int, str] | None:
    """(format, height, width, colorspace) of a JPEG or PNG from its header alone ('' as the
    PNG's colorspace), None when it is neither or its header does not parse: what a decode of
    it would allocate is known before a pixel is decoded (the agent budgets its memory so)."""
    fmt = sniff(bytes(data[:16]))
    if fmt == "png":
        head = bytes(data[12:24])
        if len(head) < 12 or head[:4] != b"IHDR":
            return None
        return "png", int.from_bytes(head[8:12], "big"), int.from_bytes(head[4:8], "big"), ""
    if fmt != "jpeg":
        return None
    import simplejpeg

    try:
        h, w, space, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return "jpeg", h, w, space


def _error_reason(message: str) -> str:
    """libjpeg's and Pillow's words for data that stops early, else corrupt."""
    low = message.lower()
    return "truncated" if "premature end of jpeg file" in low or "truncated" in low else "corrupt"


def _header_reason(data) -> str:
    """Why a JPEG header failed to parse: 'truncated' when its markers are well formed up to
    where the data ends (turbojpeg only says it "could not determine subsampling"), else corrupt."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return "corrupt"
        marker = int(data[i + 1])
        if marker == 0xFF:  # fill byte
            i += 1
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            i += 2
        elif marker == 0xDA:  # the whole header was there: something in it is wrong
            return "corrupt"
        else:
            length = (int(data[i + 2]) << 8) | int(data[i + 3])
            if length < 2:
                return "corrupt"
            i += 2 + length
    return "truncated"


def _unknown(data) -> ItemError:
    head = bytes(data[:16])
    if not any(head) and not np.any(np.frombuffer(data, np.uint8)):
        return ItemError("empty", f"{len(data)} zero bytes (a slot that was never written?)")
    name = sniff(head)
    what = f"{name} is not supported" if name else f"no known image signature ({head[:8].hex()})"
    return ItemError("unsupported_format", f"{what}; decode_image reads JPEG and PNG")


def _decode_png(data, color: str, max_pixels: int) -> np.ndarray:
    """PNG through Pillow: 16-bit samples >> 8, palette and alpha as convert("RGB") does."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise ItemError("too_large", f"{w}x{h} pixels is more than max_pixels={max_pixels}")
            im.load()
            if im.mode.startswith("I"):
                # 16-bit gray: Pillow's convert clips at 255 (white); scale by >> 8 instead.
                px = (np.asarray(im).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
                px = px[..., None]
                return np.repeat(px, 3, axis=2) if color == "rgb" else px
            px = np.asarray(im.convert("RGB" if color == "rgb" else "L"))
    except ItemError:
        raise
    except Image.DecompressionBombError as exc:
        raise ItemError("too_large", str(exc)) from None
    except (OSError, SyntaxError, ValueError) as exc:
        # Pillow names the BytesIO it could not identify by its address: the same item's detail
        # differed from run to run (items.json) and from host to agent
        why = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))
        raise ItemError(_error_reason(why), f"png: {why}") from None
    return px if px.ndim == 3 else px[..., None]


DECODED_SIZES = 4096  # image sizes a decoder remembers its decoded size for


@kernel("decode_image", "cpu")
def decode_image_cpu(nodes, consumers):
    """libjpeg-turbo through simplejpeg into a per-thread buffer (DCT-scaled when a resize
    follows), Pillow for PNG; every failure is an ItemError with a stable reason."""
    import simplejpeg

    from nicoffload.ops._imgkern import Scratch, cmyk_convert

    (node,) = nodes
    p = node.params
    color, max_pixels, fast = p["color"], p["max_pixels"], p["fast"]
    channels = 3 if color == "rgb" else 1
    consumers = tuple(consumers)
    scratch = Scratch()
    sizes: dict[tuple[int, int], tuple[int, int]] = {}  # decoded_size per header size

    def fn(data, out: np.ndarray | Alloc | None = None) -> np.ndarray:
        alloc = None
        if out is not None and not isinstance(out, np.ndarray):
            alloc, out = out, None  # an output of varying shape: decoded where alloc says
        if isinstance(data, str):  # as an agent fails it (the host's run failed, TypeError)
            raise ItemError("bad_request", "input must be bytes (an encoded image), got text")
        if len(data) == 0:
            raise ItemError("empty", "0 bytes")
        fmt = sniff(bytes(data[:16]))
        if fmt == "png":
            px = _decode_png(data, color, max_pixels)
            if alloc is not None:
                out = alloc(px.shape, px.dtype)
        elif fmt != "jpeg":
            raise _unknown(data)
        else:
            px = decode_jpeg(data, out, alloc)
        if out is not None and px is not out:
            out[...] = px
            return out
        return px

    fn.allocates = True  # type: ignore[attr-defined]

    def decode_jpeg(data, out, alloc):
        try:
            h, w, space, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            raise ItemError(_header_reason(data), f"jpeg header: {exc}") from None
        if h * w > max_pixels:
            raise ItemError("too_large", f"{w}x{h} pixels is more than max_pixels={max_pixels}")
        got = sizes.get((h, w))
        if got is None:  # Python (scaling rule, output sizes, DCT scale): once a size
            if len(sizes) >= DECODED_SIZES:
                sizes.clear()
            got = sizes[h, w] = decoded_size(p, consumers, h, w)
        sh, sw = got
        cmyk = space in ("CMYK", "YCCK")
        shape = (sh, sw, 4 if cmyk else channels)
        if out is not None and out.shape == shape and out.flags.c_contiguous and not cmyk:
            buf = out
        elif alloc is not None and not cmyk:
            buf = alloc(shape, np.uint8)
        else:
            buf = scratch.get("cmyk" if cmyk else "out", shape)
        try:
            px = simplejpeg.decode_jpeg(
                data,
                colorspace="CMYK" if cmyk else ("RGB" if channels == 3 else "GRAY"),
                fastdct=fast,
                fastupsample=fast,
                min_height=sh,
                min_width=sw,
                buffer=buf,
                strict=True,
            )
        except ValueError as exc:
            raise ItemError(_error_reason(str(exc)), f"jpeg: {exc}") from None
        if cmyk:
            shape = (sh, sw, channels)
            rgb = alloc(shape, np.uint8) if alloc is not None else scratch.get("out", shape)
            cmyk_convert(px, rgb)
            return rgb
        return px

    fn(_warm_jpeg())
    cmyk_convert(np.zeros((1, 1, 4), np.uint8), np.zeros((1, 1, channels), np.uint8))
    return fn


@kernel("decode_image", "dpu")
def decode_image_dpu(nodes, consumers):
    """The same kernel on the DPU's Arm cores (simplejpeg and numba have aarch64 wheels)."""
    return decode_image_cpu(nodes, consumers)


def _warm_jpeg() -> bytes:
    buf = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (16, 16), (90, 120, 150)).save(buf, "JPEG")
    return buf.getvalue()
