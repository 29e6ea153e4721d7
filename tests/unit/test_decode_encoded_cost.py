"""A JPEG decoder's time grows with the file's bytes as well as its pixels (entropy decoding
reads every byte): the profile fits both (`fit_encoded`), and the planner prices a decode at the
pipeline's typical bytes (or the run's inputs' mean) as well as its pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nicoffload.errors import ProfileError
from nicoffload.graph import load_pipeline
from nicoffload.planner.cost import Catalog, build_model, encoded_bytes
from nicoffload.profiles import KernelCost, Profile, load_profile, profile_from_json
from nicoffload.profiling import fit_encoded
from nicoffload.topology import local_topology

RESNET = "pipelines/resnet50.yaml"


def test_the_fit_recovers_both_features():
    rng = np.random.default_rng(0)
    pts = []
    for px in (47_000, 187_500, 424_000):
        for nbytes in (10_000, 60_000, 150_000):
            ms = 0.05 + 3e-6 * px + 1e-5 * nbytes
            pts.append((float(px), ms * (1 + rng.normal(0, 0.01)), float(nbytes)))
    a, b, c = fit_encoded(pts)
    assert b == pytest.approx(3e-6, rel=0.1) and c == pytest.approx(1e-5, rel=0.1)
    assert a >= 0


def test_points_that_cannot_tell_the_features_apart_fit_pixels_alone():
    # every file at the same bytes per pixel: the two columns are collinear
    pts = [(float(px), 1e-5 * px, 0.5 * px) for px in (1e4, 2e4, 4e4)]
    _, b, c = fit_encoded(pts)
    assert c == 0.0 and b == pytest.approx(1e-5)


def _model(tmp_path, typical_bytes: int, c_ms: float):
    text = Path(RESNET).read_text().replace("bytes: 110000", f"bytes: {typical_bytes}")
    path = tmp_path / f"p{typical_bytes}.yaml"
    path.write_text(text)
    pipeline = load_pipeline(path)
    kernels = {
        "decode_image": KernelCost(0.1, 3e-6, "pixels", (), c_ms),
        "resize": KernelCost(0.0, 1e-6, "pixels"),
        "center_crop": KernelCost(0.0, 1e-6, "pixels"),
        "normalize": KernelCost(0.0, 1e-6, "pixels"),
    }
    topology = local_topology(emulate_dpu=False, gpu=False)
    profiles = {"cpu": Profile("cpu", kernels)}
    return pipeline, build_model(pipeline, topology, profiles, Catalog.from_registry())


def test_the_planner_prices_a_decode_at_its_files_bytes(tmp_path):
    small, m_small = _model(tmp_path, 20_000, 1e-5)
    large, m_large = _model(tmp_path, 200_000, 1e-5)
    assert encoded_bytes(small)["decode"] == 20_000 and encoded_bytes(large)["resize"] == 0
    v = list(m_small.nodes).index("decode")
    assert m_large.cost[v, 0] - m_small.cost[v, 0] == pytest.approx(1e-5 * 180_000)
    # the other nodes do not read encoded bytes
    r = list(m_small.nodes).index("resize")
    assert m_large.cost[r, 0] == m_small.cost[r, 0]
    # a profile without the feature (c = 0) prices pixels only, as before
    _, m0 = _model(tmp_path, 20_000, 0.0)
    _, m1 = _model(tmp_path, 200_000, 0.0)
    assert m0.cost[v, 0] == m1.cost[v, 0]


def test_a_profile_keeps_the_per_byte_term_and_checks_it(tmp_path):
    p = Profile(
        "cpu",
        {"decode_image": KernelCost(0.1, 3e-6, "pixels", ((1.0, 2.0, 3.0),), 1.5e-5)},
        method="measured: test",
    )
    p.save(tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.kernels["decode_image"].c_ms == 1.5e-5
    assert back.kernels["decode_image"].points == ((1.0, 2.0, 3.0),)
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["kernels"]["decode_image"]["c_ms_per_byte"] = -1
    with pytest.raises(ProfileError, match="c_ms_per_byte"):
        profile_from_json(doc)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("c_ms_per_byte", float("nan")),
        ("a_ms", float("inf")),
        ("points", {"a": 1}),
        ("points", [[1.0]]),
        ("points", [[1.0, 2.0, 3.0, 4.0]]),
        ("points", [[1.0, "x"]]),
    ],
)
def test_a_profile_with_a_value_that_is_no_cost_is_refused(field, value):
    doc = Profile("cpu", {"decode_image": KernelCost(0.1, 3e-6, "pixels")}).to_json()
    doc["kernels"]["decode_image"][field] = value
    with pytest.raises(ProfileError, match=field if field != "points" else "points"):
        profile_from_json(doc)


def test_an_agent_runtime_that_is_no_number_is_refused():
    doc = Profile("cpu", {}, agent_us_per_item=10.0).to_json()
    doc["runtime"]["agent_us_per_item"] = float("nan")
    with pytest.raises(ProfileError, match="agent_us_per_item"):
        profile_from_json(doc)


def test_an_image_declared_without_its_bytes_is_priced_at_a_photos_bytes_for_its_size(tmp_path):
    text = (
        Path(RESNET)
        .read_text()
        .replace(
            "typical: {height: 375, width: 500, bytes: 110000}", "typical: {height: 32, width: 32}"
        )
    )
    (tmp_path / "tiny.yaml").write_text(text)
    tiny = load_pipeline(tmp_path / "tiny.yaml")
    assert encoded_bytes(tiny)["decode"] == round(32 * 32 * 110_000 / (500 * 375))
