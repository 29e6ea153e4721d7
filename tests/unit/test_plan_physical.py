"""The Plan carries its physical decisions (scheme, ring, batch per DPU stage) for the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.errors import DeviceError
from nicoffload.graph import load_pipeline
from nicoffload.planner import physical, plan_for
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.runner import prepare

ROOT = Path(__file__).resolve().parents[2]
RESNET = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
SPLIT = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}


def split_plan(pipeline=RESNET) -> Plan:
    stages, transfers = stages_for(pipeline, SPLIT)
    return Plan(pipeline.name, dict(SPLIT), stages, transfers, topology="local")


def test_a_planned_dpu_stage_has_its_scheme_ring_and_batch_and_they_round_trip() -> None:
    plan = plan_for(
        RESNET,
        ROOT / "pipelines/topologies/bluefield3-h100.yaml",
        objective="host-cpu",
        runnable=True,
    )
    dpu = [s for s in plan.stages if s.kind == "dpu"]
    assert dpu, plan.placement
    got = physical.of_stage(plan, dpu[0])
    assert got["scheme"] == "rdma" and got["slots"] == physical.RING_SLOTS
    assert got["batch_max_size"] == RESNET.batch_max_size
    assert Plan.from_json(plan.to_json()) == plan


def test_a_slot_holds_a_batch_of_what_the_stage_sends_on() -> None:
    plan = physical.complete(RESNET, split_plan(), None)
    crop = 224 * 224 * 3  # a static uint8 crop per item
    batch = RESNET.batch_max_size
    assert plan.physical["s0-dpu0"]["slot_bytes"] == batch * crop + batch * 64
    assert plan.physical["s0-dpu0"]["scheme"] == "tcp"  # no topology: tcp
    assert physical.complete(RESNET, plan, None) is plan  # complete already


def test_a_plan_file_without_physical_decisions_gets_them_when_it_is_run(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    split_plan().save(path)
    prep = prepare(RESNET, path)
    assert set(prep.plan.physical) == {"s0-dpu0"}


def test_a_batch_that_cannot_fit_one_slot_is_refused_with_the_batch_that_would(
    tmp_path: Path,
) -> None:
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    text = text.replace("typical: {height: 375, width: 500", "typical: {height: 9000, width: 9000")
    text = text.replace("max_size: 64", "max_size: 4096")
    (tmp_path / "big.yaml").write_text(text)
    big = load_pipeline(tmp_path / "big.yaml")
    place = {"decode": "dpu0", "resize": "cpu", "crop": "cpu", "norm": "cpu"}
    stages, transfers = stages_for(big, place)
    plan = Plan(big.name, place, stages, transfers, topology="local")
    with pytest.raises(DeviceError, match=r"set `batch: \{max_size: \d+\}`"):
        physical.complete(big, plan, None)


def test_a_placement_chosen_by_hand_is_priced_as_the_planner_prices_its_own() -> None:
    from nicoffload.errors import PlanError
    from nicoffload.planner import plan_placement

    topo = ROOT / "pipelines/topologies/bluefield3-h100.yaml"
    best = plan_for(RESNET, topo)
    again = plan_placement(RESNET, best.placement, topo)
    assert again.predicted == best.predicted and again.placement == best.placement
    assert again.physical == best.physical
    with pytest.raises(PlanError, match="every node"):
        plan_placement(RESNET, {"decode": "cpu"}, topo)
