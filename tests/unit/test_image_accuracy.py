"""The resnet50 chain's kernels against Pillow + float64 numpy, on realistic photographs.

Ours: decode (DCT scaling on) -> fused resize/crop/normalize, built from the pipeline's nodes.
Reference: `Image.open().convert("RGB")`, `resize(BILINEAR)` with torchvision's size rule,
center crop, normalize in float64. Bounds, in normalized units: mean abs <= 0.02 and 99.9th
percentile abs <= 0.1 (one uint8 level is ~0.017). The measured figures are printed (-s).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from nicoffload.graph import load_pipeline
from nicoffload.ops import get_kernel
from nicoffload.ops.crop import crop_box
from nicoffload.ops.normalize import affine
from nicoffload.ops.resize import output_size
from nicoffload.samples import sample_images

ROOT = Path(__file__).resolve().parents[2]
MEAN_BOUND, P999_BOUND = 0.02, 0.1


def chain(pipeline):
    decode, resize, crop, norm = (pipeline.node(n) for n in ("decode", "resize", "crop", "norm"))
    dec = get_kernel("decode_image", "cpu").build([decode], pipeline.consumers("decode"))
    fused = get_kernel(("resize", "center_crop", "normalize"), "cpu")
    rest = fused.build([resize, crop, norm], pipeline.consumers("norm"))
    return dec, rest


def reference(data: bytes, pipeline) -> np.ndarray:
    resize, crop, norm = (pipeline.node(n).params for n in ("resize", "crop", "norm"))
    with Image.open(io.BytesIO(data)) as im:
        img = im.convert("RGB")
    oh, ow = output_size(resize, img.height, img.width)
    img = np.asarray(img.resize((ow, oh), Image.BILINEAR), np.float64)
    (ch, cw), (top, left) = crop["size"], crop_box(oh, ow, *crop["size"])
    a, b = (np.asarray(v, np.float64) for v in affine(norm))
    return (img[top : top + ch, left : left + cw] * a + b).transpose(2, 0, 1)


def errors(pipeline, images) -> tuple[np.ndarray, int]:
    """|ours - reference| over all images (normalized units), and how many were DCT-scaled."""
    dec, rest = chain(pipeline)
    diffs, scaled = [], 0
    for _, data in images:
        decoded = dec(data)
        scaled += decoded.shape[0] < simplejpeg.decode_jpeg_header(data)[0]
        ours = rest(decoded).astype(np.float64)
        diffs.append(np.abs(ours - reference(data, pipeline)).ravel())
    return np.concatenate(diffs), scaled


def report(label: str, diff: np.ndarray, n: int, scaled: int) -> None:
    print(
        f"\n{label}: {n} images ({scaled} DCT-scaled): mean abs {diff.mean():.5f}, "
        f"p99.9 {np.percentile(diff, 99.9):.4f}, max {diff.max():.4f} (normalized units)"
    )


@pytest.fixture(scope="module")
def photos() -> list[tuple[str, bytes]]:
    return sample_images(120, seed=11)


def test_resnet50_chain_matches_pillow_within_the_bounds(photos):
    images = photos
    diff, scaled = errors(load_pipeline(ROOT / "pipelines/resnet50.yaml"), images)
    report("resnet50", diff, len(images), scaled)
    assert diff.mean() <= MEAN_BOUND
    assert np.percentile(diff, 99.9) <= P999_BOUND


@pytest.fixture
def small_resize_pipeline(tmp_path):
    """resnet50 with a small target, so most sample photos are big enough to be DCT-scaled."""
    text = (ROOT / "pipelines/resnet50.yaml").read_text()
    text = text.replace("shorter: 256", "shorter: 80").replace("size: [224, 224]", "size: [64, 64]")
    (tmp_path / "small.yaml").write_text(text)
    return load_pipeline(tmp_path / "small.yaml")


def test_dct_scaled_decodes_stay_within_the_bounds_on_their_own(small_resize_pipeline):
    big = [s for s in sample_images(160, seed=5) if len(s[1]) > 100_000]
    scaled_only = []
    dec, _ = chain(small_resize_pipeline)
    for name, data in big:
        if dec(data).shape[0] < simplejpeg.decode_jpeg_header(data)[0]:
            scaled_only.append((name, data))
    assert len(scaled_only) >= 20, "the rule should scale most photos this much larger than 80"
    diff, scaled = errors(small_resize_pipeline, scaled_only)
    report("DCT-scaled only", diff, len(scaled_only), scaled)
    assert diff.mean() <= MEAN_BOUND
    assert np.percentile(diff, 99.9) <= P999_BOUND


def test_the_sample_corpus_is_deterministic_and_photo_like(photos):
    """What the bounds above are measured on: same bytes for a seed, prefix-stable, realistic."""
    images = photos
    assert images[:8] == sample_images(8, seed=11)
    assert images[:8] != sample_images(8, seed=12)
    imagenet = [len(data) for name, data in images if "_500x375_" in name]
    assert 60_000 <= np.mean(imagenet) <= 150_000
    sizes = {simplejpeg.decode_jpeg_header(data)[:2] for _, data in images}
    assert len(sizes) >= 6 and max(h * w for h, w in sizes) == 1920 * 1080


def test_sample_texts_are_english_of_5_to_200_words():
    from nicoffload.samples import sample_texts

    texts = sample_texts(300, seed=4)
    counts = [len(text.split()) for _, text in texts]
    assert min(counts) >= 5 and max(counts) <= 200 and len(set(counts)) > 50
    assert texts == sample_texts(300, seed=4)
