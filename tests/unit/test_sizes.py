"""Plans priced at the sizes of the run's real inputs (read from headers, nothing decoded)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from nicoffload.cli import build_app
from nicoffload.graph import load_pipeline, with_typical
from nicoffload.planner import plan_for
from nicoffload.sizes import typical_of

ROOT = Path(__file__).resolve().parents[2]
RESNET = ROOT / "pipelines" / "resnet50.yaml"


def jpeg(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_the_typical_image_keeps_the_mean_pixel_count_and_bytes() -> None:
    pl = load_pipeline(RESNET)
    items = [("a", {"image": jpeg(100, 200)}), ("b", {"image": jpeg(300, 400)})]
    t = typical_of(pl, items)["image"]
    assert t["height"] == 200 and t["height"] * t["width"] == pytest.approx(70_000, rel=0.01)
    assert t["bytes"] == round(np.mean([len(v["image"]) for _, v in items]))
    # a corrupt item counts for its bytes only; texts count their characters
    t = typical_of(pl, [*items, ("c", {"image": b"\xff\xd8 not a jpeg"})])["image"]
    assert t["height"] == 200
    clip = load_pipeline(ROOT / "pipelines" / "clip.yaml")
    assert typical_of(clip, [("a", {"image": jpeg(64, 64), "text": "x" * 40})])["text"] == {
        "chars": 40
    }


def test_larger_inputs_are_priced_larger_in_every_node_after_them() -> None:
    pl = load_pipeline(RESNET)
    big = with_typical(pl, {"image": {"bytes": 400_000, "height": 1080, "width": 1920}})
    assert big.node("decode").out.typical_shape == (1080, 1920, 3)
    assert big.inputs["image"].typical_nbytes == 400_000
    assert big.node("norm").out.typical_shape == pl.node("norm").out.typical_shape  # the crop
    small = plan_for(pl, "pipelines/topologies/host-only.yaml")
    large = plan_for(big, "pipelines/topologies/host-only.yaml")
    assert large.predicted.host_cpu_ms_per_item > 3 * small.predicted.host_cpu_ms_per_item


def test_plan_input_prices_the_folders_items_and_says_so(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg(720, 1280))
    result = CliRunner().invoke(build_app(), ["plan", str(RESNET), "--input", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "priced at the sizes of the inputs" in result.output and "720x1280" in result.output
