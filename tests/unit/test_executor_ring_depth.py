"""The executor's batch slots follow the plan: a DPU placement keeps room for every batch the
agent's receiver ring may hold, plus the one being filled and the one being read (`slots` of
the plan's physical decisions), so the ring is not what caps the agent's rate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nicoffload.graph import load_pipeline
from nicoffload.planner import physical
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.runtime.executor import Executor

ROOT = Path(__file__).resolve().parents[2]


def _plan(place: dict[str, str]) -> tuple:
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    stages, transfers = stages_for(pipeline, place)
    return pipeline, Plan(pipeline.name, dict(place), stages, transfers, topology="test")


def _slots(ex: Executor) -> int:
    return len(ex._ring._all)


def test_a_dpu_lead_stage_gets_its_receiver_ring_plus_two() -> None:
    pipeline, plan = _plan({"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"})
    front = object()  # the executor only keeps it until a call runs
    assert _slots(Executor(pipeline, plan, workers=1, front=front)) == physical.RING_SLOTS + 2
    lead = plan.stages[0]
    entry = physical.stage_physical(pipeline, plan, lead, None) | {"slots": 9}
    deeper = dataclasses.replace(plan, physical={lead.name: entry})
    assert physical.ring_slots(deeper, lead) == 9
    assert _slots(Executor(pipeline, deeper, workers=1, front=front)) == 11


def test_an_all_host_plan_keeps_three_slots() -> None:
    pipeline, plan = _plan({n: "cpu" for n in ("decode", "resize", "crop", "norm")})
    assert _slots(Executor(pipeline, plan, workers=1)) == 3
