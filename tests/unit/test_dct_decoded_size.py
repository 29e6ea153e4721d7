"""The planner prices the decode the kernel runs: the cost model's decoded size of a JPEG is the
size the real CPU decode kernel produces, for every image size, resize and set of consumers
(`ops.decode.decoded_size` decides both)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

from nicoffload.graph import load_pipeline
from nicoffload.ops import get_kernel, kernel_consumers
from nicoffload.planner.cost import Catalog, build_model, effective_specs
from nicoffload.planner.solve import resolve_profiles
from nicoffload.profiles import SHIPPED_DIR
from nicoffload.topology import Device, Link, Topology

ROOT = Path(__file__).resolve().parents[2]
NORM = "{mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5], dtype: float16}"


def _pipeline(tmp_path: Path, h: int, w: int, nodes: str, outputs: str, decode: str = "") -> Path:
    text = textwrap.dedent(
        f"""\
        name: dct
        inputs: {{image: {{kind: bytes, format: jpeg, typical: {{height: {h}, width: {w}}}}}}}
        nodes:
          - {{name: decode, op: decode_image, in: image, params: {{{decode}}}}}
        """
    )
    text += textwrap.indent(textwrap.dedent(nodes), "  ") + f"outputs: {{{outputs}}}\n"
    path = tmp_path / f"p{h}x{w}.yaml"
    path.write_text(text)
    return load_pipeline(path)


def _one_resize(tmp_path: Path, h: int, w: int, resize: str, decode: str = ""):
    nodes = f"- {{name: resize, op: resize, in: decode, params: {{{resize}}}}}\n"
    return _pipeline(tmp_path, h, w, nodes, "pixels: resize", decode)


def _jpeg(h: int, w: int) -> bytes:
    rng = np.random.default_rng(h * 10_007 + w)
    img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    return simplejpeg.encode_jpeg(img, quality=80, colorsubsampling="420")


def _planned_hw(pipeline) -> tuple[int, int]:
    return effective_specs(pipeline)["decode"][1]["out"].typical_shape[:2]


def _kernel_hw(pipeline) -> tuple[int, int]:
    node = pipeline.node("decode")
    fn = get_kernel("decode_image", "cpu").build([node], kernel_consumers(pipeline, "decode"))
    h, w = node.out.typical_shape[:2]
    return fn(_jpeg(h, w)).shape[:2]


# (height, width, resize params, the decoded size): scaled only to an exact 1/2, 1/4 or 1/8 that
# still leaves the resize 3x to shrink on both sides; full size otherwise.
ONE_RESIZE = [
    (375, 500, "shorter: 256", (375, 500)),  # resnet50: no exact scale of 375 rows exists
    (375, 500, "shorter: 64", (375, 500)),  # the `shorter: 64` variant: the same
    (480, 640, "shorter: 64", (240, 320)),  # 1/2: 240 >= 3 * 64, 320 >= 3 * 85
    (480, 640, "shorter: 100", (480, 640)),  # 1/2 would leave 2.4x: full
    (960, 1280, "shorter: 40", (120, 160)),  # 1/8
    (960, 1280, "shorter: 70", (240, 320)),  # 1/4
    (512, 512, "size: [64, 64]", (256, 256)),  # 1/2 (1/4 leaves exactly 2x)
    (512, 512, "size: [40, 160]", (512, 512)),  # the wide side leaves no room
    (800, 600, "longer: 100", (400, 300)),  # 1/2 of a portrait photo (1/4 leaves 2x)
    (600, 804, "shorter: 24", (150, 201)),  # 804 / 8 and 804 / 4 are not whole: 1/2
    (36, 52, "shorter: 4", (18, 26)),  # tiny: 1/2 (36 / 8 and 36 / 4 are not whole)
    (36, 52, "shorter: 8", (36, 52)),  # 1/2 would leave 2.25x: full
]


@pytest.mark.parametrize(("h", "w", "resize", "expect"), ONE_RESIZE)
def test_the_planned_decode_size_is_the_size_the_kernel_decodes(tmp_path, h, w, resize, expect):
    pipeline = _one_resize(tmp_path, h, w, resize)
    assert _planned_hw(pipeline) == expect
    assert _kernel_hw(pipeline) == expect


def test_an_unantialiased_resize_gets_a_full_size_decode(tmp_path):
    pipeline = _one_resize(tmp_path, 480, 640, "shorter: 64, antialias: false")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (480, 640)


def test_dct_scaling_off_gets_a_full_size_decode(tmp_path):
    pipeline = _one_resize(tmp_path, 480, 640, "shorter: 64", decode="dct_scaling: false")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (480, 640)


def test_a_consumer_that_is_not_a_resize_gets_a_full_size_decode(tmp_path):
    nodes = """\
        - {name: resize, op: resize, in: decode, params: {shorter: 64}}
        - {name: crop, op: center_crop, in: decode, params: {size: 32}}
    """
    pipeline = _pipeline(tmp_path, 480, 640, nodes, "small: resize, patch: crop")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (480, 640)


def test_a_decoder_that_is_an_output_too_gets_a_full_size_decode(tmp_path):
    nodes = "- {name: resize, op: resize, in: decode, params: {shorter: 64}}\n"
    pipeline = _pipeline(tmp_path, 480, 640, nodes, "small: resize, full: decode")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (480, 640)


def test_several_resizes_are_served_at_the_size_the_largest_needs(tmp_path):
    nodes = """\
        - {name: small, op: resize, in: decode, params: {shorter: 30}}
        - {name: large, op: resize, in: decode, params: {shorter: 64}}
    """
    pipeline = _pipeline(tmp_path, 960, 1280, nodes, "a: small, b: large")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (240, 320)  # 1/4 for the 64


def test_a_decode_with_no_room_for_one_of_its_resizes_is_full_size(tmp_path):
    nodes = """\
        - {name: small, op: resize, in: decode, params: {shorter: 30}}
        - {name: large, op: resize, in: decode, params: {size: [400, 400]}}
    """
    pipeline = _pipeline(tmp_path, 960, 1280, nodes, "a: small, b: large")
    assert _planned_hw(pipeline) == _kernel_hw(pipeline) == (960, 1280)


def test_the_planned_size_matches_the_kernel_over_a_sweep_of_sizes_and_resizes(tmp_path):
    rng = np.random.default_rng(16)
    scaled = 0
    for _ in range(40):
        h, w = (int(x) for x in rng.integers(16, 1100, 2))
        resize = str(
            rng.choice(
                [
                    f"shorter: {rng.integers(1, max(2, min(h, w) // 2))}",
                    f"longer: {rng.integers(1, max(2, max(h, w) // 2))}",
                    f"size: [{rng.integers(1, h)}, {rng.integers(1, w)}]",
                ]
            )
        )
        pipeline = _one_resize(tmp_path, h, w, resize)
        planned = _planned_hw(pipeline)
        assert planned == _kernel_hw(pipeline), (h, w, resize)
        scaled += planned != (h, w)
    assert scaled >= 3  # the sweep does reach scaled decodes, not only full ones


IMAGE = Catalog({op: frozenset({"cpu", "dpu", "gpu"}) for op in ("decode_image", "resize")})


def _local_like(gpu: bool) -> Topology:
    """This machine's shape (host CPU, an emulated DPU on loopback, maybe a GPU) with the
    shipped estimates, never a measured profile."""
    x86 = str(SHIPPED_DIR / "x86-server.json")
    devices = [
        Device("cpu", "cpu", 2, 2.0, profile=x86),
        Device("dpu0", "dpu", 2, 2.0, profile=x86, emulated=True),
    ]
    links = [Link("dpu0", "cpu", "tcp", 2.5e9, 0.03, 0.25)]
    if gpu:
        devices.append(Device("gpu0", "gpu", 1, 1.0, profile=str(SHIPPED_DIR / "h100.json")))
        links.append(Link("cpu", "gpu0", "pcie", 25e9, 0.005, 0.0))
    return Topology("local-like", tuple(devices), tuple(links), "dpu0", "gpu0" if gpu else "cpu")


def test_resnet50_decode_is_priced_at_the_full_size_it_decodes(tmp_path):
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    for shorter in (256, 64):
        path = tmp_path / f"r{shorter}.yaml"
        path.write_text(text.replace("shorter: 256", f"shorter: {shorter}"))
        pipeline = load_pipeline(path)
        topo = _local_like(gpu=False)
        profiles = resolve_profiles(topo)
        model = build_model(pipeline, topo, profiles, IMAGE)
        full = profiles["cpu"].kernel("decode_image").ms(375 * 500)
        assert model.cost[model.nodes.index("decode")] == pytest.approx([full, full])


def test_a_gpu_decoder_is_priced_at_full_size_where_the_cpu_one_scales(tmp_path):
    pipeline = _one_resize(tmp_path, 960, 1280, "shorter: 70")
    topo = _local_like(gpu=True)
    profiles = resolve_profiles(topo)
    model = build_model(pipeline, topo, profiles, IMAGE)
    v = model.nodes.index("decode")
    assert model.cost[v, 0] == pytest.approx(profiles["cpu"].kernel("decode_image").ms(240 * 320))
    assert model.cost[v, 2] == pytest.approx(profiles["gpu0"].kernel("decode_image").ms(960 * 1280))


def test_a_decoded_image_that_is_an_output_is_full_size_though_a_resize_reads_it(tmp_path):
    """The decoder may decode smaller (in the DCT domain) for a resize that reads it, but not
    when its own image is returned too: that output must be the image, not a thumbnail."""
    import simplejpeg

    import nicoffload

    image = np.random.default_rng(0).integers(0, 255, (1024, 1536, 3), dtype=np.uint8)
    jpeg = simplejpeg.encode_jpeg(image, quality=90)
    both = tmp_path / "both.yaml"
    both.write_text(
        """
name: both
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image}
  - {name: small, op: resize, in: decode, params: {size: [64, 96]}}
outputs: {full: decode, small: small}
batch: {max_size: 2, max_wait_ms: 2}
"""
    )
    alone = tmp_path / "alone.yaml"
    alone.write_text(
        """
name: alone
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image}
outputs: {full: decode}
batch: {max_size: 2, max_wait_ms: 2}
"""
    )
    got = nicoffload.run(both, [jpeg])
    want = nicoffload.run(alone, [jpeg])
    assert got.ok.all() and want.ok.all()
    assert got.outputs["full"][0].shape == (1024, 1536, 3)
    np.testing.assert_array_equal(got.outputs["full"][0], want.outputs["full"][0])


@pytest.mark.xfail(
    strict=True,
    reason="the cost model has one size per tensor, the CPU/DPU decoder's: what reads a GPU "
    "decoder's full-size image (a resize's work, the bytes it crosses a link with) is priced "
    "at the DCT-scaled size",
)
def test_what_reads_a_gpu_decoders_image_is_priced_at_its_full_size(tmp_path):
    from nicoffload.ops.resize import output_size
    from nicoffload.planner.evaluate import evaluate

    pipeline = _one_resize(tmp_path, 960, 1280, "shorter: 70")  # a CPU decode is 1/4: 240x320
    topo = _local_like(gpu=True)
    profiles = resolve_profiles(topo)
    model = build_model(pipeline, topo, profiles, IMAGE)
    on = {"decode": "gpu0", "resize": "cpu"}  # nvJPEG decodes 960x1280, the host resizes it
    P = np.array([model.devices.index(on[name]) for name in model.nodes])
    oh, ow = output_size(pipeline.node("resize").params, 960, 1280)
    want = profiles["cpu"].kernel("resize").ms(960 * 1280 + oh * ow)
    assert evaluate(model, P[None, :]).work[0, model.devices.index("cpu")] == pytest.approx(want)
