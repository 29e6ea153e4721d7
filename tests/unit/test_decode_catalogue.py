"""The bad-image catalogue: every odd input either decodes like Pillow or fails as one ItemError.

Each entry makes its bytes from scratch; `PIL` means "decodes, equal to Pillow's
`Image.open().convert('RGB')`", anything else is the ItemError reason the kernel must give.
A truncated JPEG that libjpeg could still finish (padding the rest with gray) is an error,
`truncated`, as it is for Pillow: a half-gray photo is not a valid input.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from kernel_contract import make_chain
from PIL import Image

from nicoffload.errors import ItemError
from nicoffload.graph import Dim, TensorSpec
from nicoffload.ops import get_kernel

PIL = "decodes like Pillow"


def photo(h: int = 60, w: int = 80) -> np.ndarray:
    """A smooth color image (random 8x10 blown up), so JPEG artifacts stay small."""
    small = np.random.default_rng(7).integers(0, 256, (8, 10, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


def save(img: Image.Image | np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    (Image.fromarray(img) if isinstance(img, np.ndarray) else img).save(buf, fmt, **kw)
    return buf.getvalue()


def jpeg(**kw) -> bytes:
    return save(photo(), "JPEG", quality=90, **kw)


def png16() -> bytes:
    ramp = (np.arange(60 * 80, dtype=np.uint32) * 13 % 65536).astype(np.uint16)
    return save(Image.fromarray(ramp.reshape(60, 80)), "PNG")


def huge_sof() -> bytes:
    data = bytearray(jpeg())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)
    return bytes(data)


def huge_ihdr() -> bytes:
    data = bytearray(save(photo(), "PNG"))
    data[16:24] = struct.pack(">II", 100_000, 100_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def corrupt_scan() -> bytes:
    data = jpeg()
    mid = (data.index(b"\xff\xda") + len(data)) // 2
    return data[:mid] + b"\xff\xd0" + data[mid:]  # a restart marker the header never announced


CATALOGUE = {
    "baseline 4:2:0 JPEG": (lambda: jpeg(subsampling=2), PIL),
    "4:2:2 JPEG": (lambda: jpeg(subsampling=1), PIL),
    "4:4:4 JPEG": (lambda: jpeg(subsampling=0), PIL),
    "progressive JPEG": (lambda: jpeg(progressive=True), PIL),
    "grayscale JPEG": (lambda: save(Image.fromarray(photo()).convert("L"), "JPEG"), PIL),
    "CMYK JPEG (Adobe, inverted)": (
        lambda: save(Image.fromarray(photo()).convert("CMYK"), "JPEG"),
        PIL,
    ),
    "PNG named .jpg": (lambda: save(photo(), "PNG"), PIL),
    "palette PNG": (lambda: save(Image.fromarray(photo()).convert("P"), "PNG"), PIL),
    "RGBA PNG": (lambda: save(Image.fromarray(photo()).convert("RGBA"), "PNG"), PIL),
    "gray PNG": (lambda: save(Image.fromarray(photo()).convert("L"), "PNG"), PIL),
    "zero bytes": (lambda: b"", "empty"),
    "a never-written slot (all zeros)": (lambda: bytes(4096), "empty"),
    "random bytes": (lambda: np.random.default_rng(3).bytes(5000), "unsupported_format"),
    "GIF": (lambda: save(photo(), "GIF"), "unsupported_format"),
    "BMP": (lambda: save(photo(), "BMP"), "unsupported_format"),
    "WebP": (lambda: b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(40), "unsupported_format"),
    "truncated JPEG (half)": (lambda: jpeg()[: len(jpeg()) // 2], "truncated"),
    "JPEG without its last 2 bytes (EOI)": (lambda: jpeg()[:-2], "truncated"),
    "JPEG cut inside its header": (lambda: jpeg()[:200], "truncated"),
    "JPEG magic then garbage": (lambda: b"\xff\xd8\xff" + bytes(range(1, 200)), "corrupt"),
    "JPEG with a corrupt scan": (corrupt_scan, "corrupt"),
    "truncated PNG": (lambda: save(photo(), "PNG")[:300], "truncated"),
    "JPEG header claiming 60000x60000": (huge_sof, "too_large"),
    "PNG header claiming 100000x100000": (huge_ihdr, "too_large"),
}


def decoder(**params):
    spec = TensorSpec("bytes", (Dim("nbytes", 1000),))
    nodes = make_chain(("decode_image",), [params], spec)
    return get_kernel("decode_image", "cpu").build(nodes, ())


@pytest.fixture(scope="module")
def decode():
    return decoder()


def pillow(data: bytes, mode: str = "RGB") -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        px = np.asarray(im.convert(mode))
    return px if px.ndim == 3 else px[..., None]


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue_entry_decodes_like_pillow_or_fails_with_its_reason(decode, name):
    make, expected = CATALOGUE[name]
    data = make()
    if expected == PIL:
        np.testing.assert_array_equal(decode(data), pillow(data))
    else:
        with pytest.raises(ItemError) as caught:
            decode(data)
        assert caught.value.reason == expected, caught.value.detail


def test_16_bit_png_keeps_the_high_byte_where_pillow_would_clip_to_white(decode):
    data = png16()
    with Image.open(io.BytesIO(data)) as im:
        high = (np.asarray(im).astype(np.uint32) >> 8).astype(np.uint8)
    np.testing.assert_array_equal(decode(data), np.stack([high] * 3, -1))


def test_pixels_beyond_max_pixels_are_refused_before_decoding():
    small = decoder(max_pixels=60 * 80 - 1)
    for data in (jpeg(), save(photo(), "PNG")):
        with pytest.raises(ItemError) as caught:
            small(data)
        assert caught.value.reason == "too_large"


def test_gray_output_of_gray_inputs_equals_pillow():
    gray = decoder(color="gray")
    for data in (save(Image.fromarray(photo()).convert("L"), "JPEG"), save(photo(), "PNG")):
        np.testing.assert_array_equal(gray(data), pillow(data, "L"))


def test_gray_output_of_a_color_jpeg_is_its_coded_luma_close_to_pillows_l():
    data = jpeg()
    diff = np.abs(decoder(color="gray")(data).astype(int) - pillow(data, "L"))
    assert diff.max() <= 2 and diff.mean() < 0.5


def test_cmyk_jpeg_to_gray_equals_pillow():
    data = save(Image.fromarray(photo()).convert("CMYK"), "JPEG")
    np.testing.assert_array_equal(decoder(color="gray")(data), pillow(data, "L"))


def test_every_failure_names_what_went_wrong(decode):
    with pytest.raises(ItemError) as caught:
        decode(save(photo(), "GIF"))
    assert "gif" in caught.value.detail


def test_fast_decoding_is_off_by_default_and_only_approximately_pillow():
    """libjpeg-turbo's fast IDCT and upsampling: 1-2.5 levels off on average on photographs
    (more at chroma edges), which alone would break the resnet50 accuracy bound."""
    from nicoffload.samples import sample_image

    data = sample_image(3)[1]  # a 500x375 4:2:0 photograph
    exact, fast = decoder(), decoder(fast=True)
    np.testing.assert_array_equal(exact(data), pillow(data))
    diff = np.abs(fast(data).astype(int) - pillow(data))
    assert 0 < diff.mean() < 3
