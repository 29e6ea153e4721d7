"""A progressive JPEG takes about 3x a baseline one's decode (every scan passes over the
coefficients again): `profile` measures the ratio on the same photos (`progressive_x`), the
run's inputs say what share is progressive (`sizes.typical_of`, or `typical.progressive` in the
pipeline), and the planner prices the decoder at the mix."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nicoffload.errors import SpecError
from nicoffload.graph import load_pipeline, with_typical
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.profiles import KernelCost, Profile, profile_from_json
from nicoffload.sizes import describe, typical_of
from nicoffload.topology import local_topology

RESNET = Path(__file__).resolve().parents[2] / "pipelines" / "resnet50.yaml"


def jpeg(progressive: bool, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90, progressive=progressive)
    return buf.getvalue()


def test_the_share_of_progressive_jpegs_is_read_from_their_headers() -> None:
    pipeline = load_pipeline(RESNET)
    items = [(str(i), {"image": jpeg(i % 4 == 0, i)}) for i in range(8)]  # 2 of 8
    typical = typical_of(pipeline, items)["image"]
    assert typical["progressive"] == 0.25 and (typical["height"], typical["width"]) == (60, 80)
    assert "25% progressive" in describe({"image": typical})
    baseline = typical_of(pipeline, [(str(i), {"image": jpeg(False, i)}) for i in range(4)])
    assert "progressive" not in baseline["image"]  # none: as before


def _decode_ms(pipeline, progressive_x: float | None) -> float:
    kernels = {
        "decode_image": KernelCost(0.1, 3e-6, "pixels", (), 1e-6, progressive_x),
        "resize": KernelCost(0.0, 1e-6, "pixels"),
        "center_crop": KernelCost(0.0, 1e-6, "pixels"),
        "normalize": KernelCost(0.0, 1e-6, "pixels"),
    }
    topology = local_topology(emulate_dpu=False, gpu=False)
    model = build_model(
        pipeline, topology, {"cpu": Profile("cpu", kernels)}, Catalog.from_registry()
    )
    return float(model.cost[model.nodes.index("decode"), 0])


def with_progressive(pipeline, share: float):
    """The pipeline at its typical image size and 110 KB, a `share` of it progressive."""
    t = dict(pipeline.inputs["image"].hints)
    typical = {"height": t["height"], "width": t["width"], "bytes": 110_000, "progressive": share}
    return with_typical(pipeline, {"image": typical})


def test_the_decoder_is_priced_at_the_mix() -> None:
    pipeline = load_pipeline(RESNET)
    base = _decode_ms(pipeline, 3.0)
    mixed = with_progressive(pipeline, 0.5)
    assert _decode_ms(mixed, 3.0) == pytest.approx(base * (1 + 0.5 * 2.0))
    assert _decode_ms(mixed, None) == pytest.approx(base)  # not measured: priced as baseline
    assert _decode_ms(pipeline, 3.0) == pytest.approx(base)  # no progressive items


def test_a_pipeline_may_declare_its_share_and_only_as_a_fraction(tmp_path: Path) -> None:
    text = RESNET.read_text().replace("bytes: 110000", "bytes: 110000, progressive: 0.2")
    assert "progressive: 0.2" in text
    (tmp_path / "p.yaml").write_text(text)
    pipeline = load_pipeline(tmp_path / "p.yaml")
    assert dict(pipeline.inputs["image"].hints)["progressive"] == 0.2
    (tmp_path / "bad.yaml").write_text(text.replace("progressive: 0.2", "progressive: 2"))
    with pytest.raises(SpecError, match="progressive"):
        load_pipeline(tmp_path / "bad.yaml")


def test_a_profile_keeps_the_ratio() -> None:
    cost = KernelCost(0.1, 3e-6, "pixels", ((1.0, 2.0, 3.0),), 1e-6, 2.87)
    doc = Profile("cpu", {"decode_image": cost}).to_json()
    assert doc["kernels"]["decode_image"]["progressive_x"] == 2.87
    assert profile_from_json(doc).kernels["decode_image"].progressive_x == 2.87
    del doc["kernels"]["decode_image"]["progressive_x"]
    assert profile_from_json(doc).kernels["decode_image"].progressive_x is None


def test_only_a_jpeg_input_may_declare_a_progressive_share(tmp_path: Path) -> None:
    bert = (RESNET.parent / "bert.yaml").read_text()
    assert "typical: {chars: 300}" in bert
    text = bert.replace("typical: {chars: 300}", "typical: {chars: 300, progressive: 0.5}")
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(SpecError, match="is for JPEG inputs"):
        load_pipeline(tmp_path / "t.yaml")


def test_a_ratio_of_zero_is_refused_not_read_as_absent() -> None:
    from nicoffload.errors import ProfileError

    doc = Profile("cpu", {"decode_image": KernelCost(0.1, 3e-6, "pixels", (), 0.0, 2.0)}).to_json()
    doc["kernels"]["decode_image"]["progressive_x"] = 0
    with pytest.raises(ProfileError, match="ratio > 0"):
        profile_from_json(doc)


def test_a_gpu_profiles_own_ratio_prices_nothing() -> None:
    """The GPU decoder never sees the progressive files (host threads decode them): its
    share of the time is its baseline figure, whatever ratio its profile carries."""
    from nicoffload.planner.solve import resolve_profiles, resolve_topology

    pipeline = load_pipeline(RESNET)
    mixed = with_progressive(pipeline, 0.25)
    topo = resolve_topology(RESNET.parent / "topologies" / "bluefield3-h100.yaml")
    profiles = resolve_profiles(topo)

    def gpu_decode_ms(ratio) -> float:
        gpu = profiles["gpu0"]
        entry = dataclasses.replace(gpu.kernels["decode_image"], progressive_x=ratio)
        profs = {
            **profiles,
            "gpu0": dataclasses.replace(gpu, kernels={**gpu.kernels, "decode_image": entry}),
        }
        model = build_model(mixed, topo, profs, Catalog.from_registry())
        return float(model.cost[model.nodes.index("decode"), model.devices.index("gpu0")])

    assert gpu_decode_ms(None) == gpu_decode_ms(10.0) > 0


def test_the_share_a_gpu_decoder_leaves_to_the_host_is_read_from_the_headers() -> None:
    """Gray and progressive files are not for the GPU's batched decode (`nvjpeg_takes`)."""
    pipeline = load_pipeline(RESNET)

    def gray(seed: int) -> bytes:
        buf = io.BytesIO()
        img = np.random.default_rng(seed).integers(0, 255, (60, 80), dtype=np.uint8)
        Image.fromarray(img, "L").save(buf, "JPEG", quality=90)
        return buf.getvalue()

    items = [gray(0), jpeg(True, 1), jpeg(False, 2), jpeg(False, 3)]
    typical = typical_of(pipeline, [(str(i), {"image": b}) for i, b in enumerate(items)])["image"]
    assert typical["progressive"] == 0.25 and typical["host_decoded"] == 0.5
    assert "50% not for the GPU's batched decode" in describe({"image": typical})
    baseline = typical_of(pipeline, [(str(i), {"image": jpeg(False, i)}) for i in range(3)])
    assert "host_decoded" not in baseline["image"]
