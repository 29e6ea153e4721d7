"""The agent stamps the ids the NIC steers on: the plan's pipeline id and the next stage's id."""

from __future__ import annotations

import json
from pathlib import Path

from dpu_agents.stagebuild import build_stage
from nicoffload.graph import load_pipeline
from nicoffload.p4.ids import pipeline_id, stage_ids
from nicoffload.planner.plan import Plan, stages_for


def test_a_loaded_stage_forwards_with_the_pipeline_id_and_the_next_stage_id():
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    placement = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}
    stages, transfers = stages_for(pipeline, placement)
    plan = Plan(pipeline.name, placement, stages, transfers)
    built = build_stage(
        Path("pipelines/resnet50.yaml").read_text(), json.dumps(plan.to_json()), "s0-dpu0", 8, 2.0
    )
    assert built.pipeline_id == pipeline_id("resnet50-preprocess") != 0
    assert built.next_stage_id == stage_ids(plan)["s1-cpu"] == 2
