"""GPU image kernels against the float64 / Pillow reference of the ops' semantics.

uint8 results (resize, crop) must be bit-exact with Pillow; normalized results within one
rounding to the output dtype. Outputs are poisoned first, so an unwritten pixel fails.
"""

from __future__ import annotations

import gpu_reference as ref
import numpy as np
import pytest

from nicoffload import ops
from nicoffload.errors import ItemError
from nicoffload.graph import load_pipeline

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# (h, w): ImageNet-like, portrait, odd, 1080p, smaller than the crop (padding), square,
# extreme aspect ratios (upsampling along one axis), tiny.
SIZES = [
    (375, 500),
    (500, 333),
    (333, 499),
    (1080, 1920),
    (100, 80),
    (224, 224),
    (7, 1000),
    (1200, 31),
    (1, 1),
]


def build(tmp_path, nodes: str, chain: tuple[str, ...], color: str = "rgb"):
    lines = (
        f"  - {{name: decode, op: decode_image, in: image, params: {{color: {color}}}}}\n" + nodes
    )
    pipeline = load_pipeline(ref.write_pipeline(tmp_path, lines, "last"))
    chain_nodes = [n for n in pipeline.nodes if n.name != "decode"]
    assert tuple(n.op for n in chain_nodes) == chain
    k = ops.get_kernel(chain, "gpu")
    return k.build(chain_nodes, ()), chain_nodes


def images(seed: int, channels: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in SIZES]


def host(t) -> np.ndarray:
    return t.float().cpu().numpy() if t.dtype.is_floating_point else t.cpu().numpy()


def test_resize_then_center_crop_is_bit_exact_with_pillow(gpu, tmp_path):
    fn, nodes = build(
        tmp_path,
        "  - {name: resize, op: resize, in: decode, params: {shorter: 256}}\n"
        "  - {name: last, op: center_crop, in: resize, params: {size: [224, 224]}}\n",
        ("resize", "center_crop"),
    )
    imgs = images(1)
    out = gpu.empty((len(imgs), 224, 224, 3), gpu.torch.uint8).fill_(7)
    got = host(fn(imgs, out=out))
    for i, img in enumerate(imgs):
        want = ref.center_crop(ref.resize(img, nodes[0].params), (224, 224))
        np.testing.assert_array_equal(got[i], want, err_msg=f"image {img.shape}")


def test_resize_alone_returns_each_size_bit_exact(gpu, tmp_path):
    fn, nodes = build(
        tmp_path,
        "  - {name: last, op: resize, in: decode, params: {shorter: 256}}\n",
        ("resize",),
    )
    imgs = images(2)[:6]
    got = fn(imgs)
    for img, t in zip(imgs, got, strict=True):
        np.testing.assert_array_equal(host(t), ref.resize(img, nodes[0].params))


def test_the_fixed_point_reference_is_pillow(gpu):
    img = images(3)[0]
    np.testing.assert_array_equal(
        ref.resize_fixed_point(img, 256, 341, antialias=True),
        ref.resize(img, {"shorter": 256, "longer": None, "size": None}),
    )


def test_resize_to_a_fixed_size_without_antialias_is_bit_exact(gpu, tmp_path):
    fn, _ = build(
        tmp_path,
        "  - {name: last, op: resize, in: decode, params: {size: [100, 150], antialias: false}}\n",
        ("resize",),
    )
    imgs = images(3)[:5]
    got = fn(imgs)
    assert tuple(got.shape) == (5, 100, 150, 3)
    for img, g in zip(imgs, host(got), strict=True):
        np.testing.assert_array_equal(g, ref.resize_fixed_point(img, 100, 150, antialias=False))


@pytest.mark.parametrize("dtype,layout", [("float16", "chw"), ("float32", "hwc")])
def test_fused_resize_crop_normalize_matches_the_reference(gpu, tmp_path, dtype, layout):
    fn, nodes = build(
        tmp_path,
        "  - {name: resize, op: resize, in: decode, params: {shorter: 256}}\n"
        "  - {name: crop, op: center_crop, in: resize, params: {size: [224, 224]}}\n"
        f"  - {{name: last, op: normalize, in: crop, params: {{mean: {MEAN}, std: {STD}, dtype: {dtype}, layout: {layout}}}}}\n",
        ("resize", "center_crop", "normalize"),
    )
    imgs = images(4)
    shape = (3, 224, 224) if layout == "chw" else (224, 224, 3)
    out = gpu.empty((len(imgs), *shape), getattr(gpu.torch, dtype)).fill_(float("nan"))
    got = host(fn(imgs, out=out))
    for i, img in enumerate(imgs):
        want = ref.normalize(
            ref.center_crop(ref.resize(img, nodes[0].params), (224, 224)), nodes[2].params
        )
        ref.assert_close_to_dtype(got[i], want, dtype)


def test_gray_images_go_through_the_fused_kernel(gpu, tmp_path):
    fn, nodes = build(
        tmp_path,
        "  - {name: resize, op: resize, in: decode, params: {shorter: 64}}\n"
        "  - {name: crop, op: center_crop, in: resize, params: {size: 56}}\n"
        "  - {name: last, op: normalize, in: crop, params: {mean: [0.5], std: [0.25], dtype: float32}}\n",
        ("resize", "center_crop", "normalize"),
        color="gray",
    )
    imgs = images(5, channels=1)
    got = host(fn(imgs))
    for i, img in enumerate(imgs):
        want = ref.normalize(
            ref.center_crop(ref.resize(img, nodes[0].params), (56, 56)), nodes[2].params
        )
        ref.assert_close_to_dtype(got[i], want, "float32")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_normalize_dense_batch_and_ragged_list_agree_with_the_reference(
    gpu, tmp_path, dtype, layout
):
    # normalize alone on a static 224x224 input: the dense vectorized path (flat over the batch,
    # 16-byte stores), against the reference and, bit for bit, against the general path
    pipeline = load_pipeline(
        ref.write_pipeline(
            tmp_path,
            "  - {name: decode, op: decode_image, in: image}\n"
            "  - {name: resize, op: resize, in: decode, params: {size: [224, 224]}}\n"
            f"  - {{name: last, op: normalize, in: resize, params: {{mean: {MEAN}, std: {STD}, "
            f"dtype: {dtype}, layout: {layout}}}}}\n",
            "last",
            "dense",
        )
    )
    node = pipeline.node("last")
    dense = ops.get_kernel("normalize", "gpu").build([node], ())
    rng = np.random.default_rng(6)
    n = 7  # the flat grid's last block is partly idle
    batch = rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)
    t = gpu.upload(batch)
    torch = gpu.torch
    shape = (n, 3, 224, 224) if layout == "chw" else (n, 224, 224, 3)
    out = gpu.empty((n + 1, *shape[1:]), getattr(torch, dtype)).fill_(float("nan"))
    got = host(dense(t, out=out[:n]))
    assert np.isnan(host(out[n])).all()  # nothing written past the batch
    for i in range(n):
        ref.assert_close_to_dtype(got[i], ref.normalize(batch[i], node.params), dtype)
    # the same kernel on a list of strided views takes the general path: identical results
    views = [t[i][:, :, :] for i in range(n)]
    np.testing.assert_array_equal(host(dense(views)), got)


def test_center_crop_pads_with_zeros_when_the_image_is_smaller(gpu, tmp_path):
    fn, _ = build(
        tmp_path,
        "  - {name: last, op: center_crop, in: decode, params: {size: [64, 48]}}\n",
        ("center_crop",),
    )
    imgs = [
        np.random.default_rng(7).integers(0, 256, s, dtype=np.uint8)
        for s in [(30, 100, 3), (64, 48, 3), (65, 47, 3)]
    ]
    got = host(fn(imgs))
    for i, img in enumerate(imgs):
        np.testing.assert_array_equal(got[i], ref.center_crop(img, (64, 48)))


def test_failed_rows_are_skipped_and_zeroed(gpu, tmp_path):
    fn, _ = build(
        tmp_path,
        "  - {name: resize, op: resize, in: decode, params: {shorter: 256}}\n"
        "  - {name: last, op: center_crop, in: resize, params: {size: [224, 224]}}\n",
        ("resize", "center_crop"),
    )
    imgs = images(8)[:3]
    failed = {1: ItemError("corrupt", "test")}
    out = gpu.empty((3, 224, 224, 3), gpu.torch.uint8).fill_(9)
    got = host(fn([imgs[0], None, imgs[2]], out=out, failed=failed))
    assert (got[1] == 0).all()
    assert set(failed) == {1}
    np.testing.assert_array_equal(
        got[2],
        ref.center_crop(
            ref.resize(imgs[2], {"shorter": 256, "longer": None, "size": None}), (224, 224)
        ),
    )
