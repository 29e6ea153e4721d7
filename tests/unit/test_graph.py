"""Building pipelines: shape/dtype inference across edges, the public API, the JSON Schema."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

import nicoffload
from nicoffload.graph import Dim, load_pipeline
from nicoffload.ops.resize import output_size
from nicoffload.schema import pipeline_schema

PIPELINES = sorted(Path(__file__).resolve().parents[2].joinpath("pipelines").glob("*.yaml"))


def test_public_api_is_exactly_the_curated_names():
    assert sorted(nicoffload.__all__) == sorted(
        [
            "Client",
            "ItemError",
            "NicoffloadError",
            "Node",
            "Pipeline",
            "Plan",
            "PlanError",
            "RunResult",
            "RunStats",
            "Session",
            "SessionClosed",
            "SpecError",
            "SystemFailure",
            "TensorSpec",
            "TransportError",
            "UserError",
            "__version__",
            "load_pipeline",
            "open",
            "run",
        ]
    )
    for name in nicoffload.__all__:
        assert hasattr(nicoffload, name)


def test_resnet50_shapes_are_inferred_on_every_edge():
    p = load_pipeline("pipelines/resnet50.yaml")
    specs = {n.name: n.out for n in p.nodes}
    assert specs["decode"].dtype == "uint8" and isinstance(specs["decode"].shape[0], Dim)
    assert specs["resize"].typical_shape == (256, 341, 3)
    assert specs["crop"].shape == (224, 224, 3)
    assert (specs["norm"].dtype, specs["norm"].shape, specs["norm"].layout) == (
        "float16",
        (3, 224, 224),
        "chw",
    )
    assert specs["crop"].typical_nbytes == 224 * 224 * 3


def test_clip_is_a_dag_with_two_branches_and_three_outputs():
    p = load_pipeline("pipelines/clip.yaml")
    assert set(p.outputs) == {"pixels", "input_ids", "attention_mask"}
    assert p.output_specs()["input_ids"].shape == (77,)
    assert [n.name for n in p.consumers("decode")] == ["resize"]


@pytest.mark.parametrize(
    ("h", "w", "want"),
    [
        (375, 500, (256, 341)),
        (500, 375, (341, 256)),
        (256, 256, (256, 256)),
        (1080, 1920, (256, 455)),
    ],
)
def test_resize_shorter_side_follows_torchvision(h, w, want):
    params = {"shorter": 256, "longer": None, "size": None}
    assert output_size(params, h, w) == want


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_shipped_pipelines_validate_and_match_the_json_schema(path):
    load_pipeline(path)
    jsonschema.validate(yaml.safe_load(path.read_text()), pipeline_schema())


def test_json_schema_rejects_an_unknown_parameter():
    doc = yaml.safe_load(Path("pipelines/resnet50.yaml").read_text())
    doc["nodes"][1]["params"]["shortr"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, pipeline_schema())
