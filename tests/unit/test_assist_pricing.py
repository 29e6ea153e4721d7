"""Host assist in the plan: how it is priced (`planner.assist`), when the planner chooses it,
and how the plan carries it (`physical.host_share`) to the runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from nicoffload.errors import PlanError
from nicoffload.graph import load_pipeline
from nicoffload.planner import assist, physical, plan_for, plan_placement
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.planner.evaluate import evaluate
from nicoffload.planner.plan import Plan
from nicoffload.planner.solve import resolve_profiles, resolve_topology
from nicoffload.runtime.chain import Chain

ROOT = Path(__file__).resolve().parents[2]
RESNET = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
BF3 = ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml"
ALL_DPU = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "dpu0"}
ALL_HOST = dict.fromkeys(ALL_DPU, "cpu")


def model_of(topology=BF3):
    topo = resolve_topology(topology)
    return build_model(RESNET, topo, resolve_profiles(topo), Catalog.from_registry())


def row(model, placement: dict[str, str]) -> np.ndarray:
    return np.array([model.devices.index(placement[n]) for n in model.nodes], dtype=np.intp)


def test_the_host_takes_what_every_resource_has_room_for_beside_the_agents_path():
    model = model_of()
    P = row(model, ALL_DPU)
    a = assist.assisted(model, P)
    assert a is not None and 0 < a.host_share < 1
    x, y = a.agent_per_s / 1e3, (a.throughput_per_s - a.agent_per_s) / 1e3
    F = P.copy()
    F[:] = model.devices.index("cpu")
    m = evaluate(model, np.stack([P, F]))
    base = model.base if model.base is not None else 0.0
    load = (m.work + base) / model.divisor
    used = x * load[0] + y * load[1]  # ms of each resource per ms
    serial = x * m.serial[0] + y * m.serial[1]
    # nothing is over its capacity, and the busiest resource is full: the host took all it could
    assert used.max() <= 1 + 1e-6 and serial <= 1 + 1e-6
    assert max(used.max(), serial) == pytest.approx(1.0, rel=1e-4)


def test_a_placement_without_a_leading_dpu_stage_has_no_host_assist():
    model = model_of()
    assert assist.assisted(model, row(model, ALL_HOST)) is None
    tail = {"decode": "cpu", "resize": "dpu0", "crop": "dpu0", "norm": "dpu0"}
    assert assist.assisted(model, row(model, tail)) is None


def test_without_asking_no_plan_is_assisted():
    plan = plan_for(RESNET, BF3)
    assert not any(physical.host_share(plan, s) for s in plan.stages)


def test_the_throughput_plan_is_assisted_where_that_beats_every_plain_plan():
    plan = plan_for(RESNET, BF3, explain=True, host_assist=True)
    share = physical.host_share(plan, plan.stages[0])
    assert plan.stages[0].kind == "dpu" and 0 < share < 1
    info = plan.explain["host_assist"]
    assert info["host_share"] == share
    assert plan.predicted.throughput_per_s > assist.GAIN * info["best_without"]["throughput_per_s"]
    assert plan.explain["runner_up"]["lost_on"] == "throughput"
    assert any(n.startswith("host assist:") for n in plan.notes)
    assert plan.search["host_assist_weighed"] >= 2


def test_a_throughput_floor_only_an_assisted_plan_meets_is_met_by_it():
    """With host assist asked for, `--min-throughput` above every plain placement's rate is
    met by the assisted plan, not refused; above the assisted one's too, it is refused."""
    assisted = plan_for(RESNET, BF3, explain=True, host_assist=True)
    plain = assisted.explain["host_assist"]["best_without"]["throughput_per_s"]
    fast = assisted.predicted.throughput_per_s
    floor = (plain + fast) / 2
    with pytest.raises(PlanError):
        plan_for(RESNET, BF3, min_throughput_per_s=floor)
    plan = plan_for(RESNET, BF3, min_throughput_per_s=floor, host_assist=True)
    assert physical.host_share(plan, plan.stages[0]) > 0
    assert plan.predicted.throughput_per_s >= floor
    assert plan.placement == assisted.placement
    with pytest.raises(PlanError):
        plan_for(RESNET, BF3, min_throughput_per_s=fast * 1.5, host_assist=True)


def test_the_host_cpu_and_latency_plans_are_never_assisted():
    for objective in ("host-cpu", "latency"):
        plan = plan_for(RESNET, BF3, objective=objective, host_assist=True)
        assert not any(physical.host_share(plan, s) for s in plan.stages), objective


def test_an_assisted_plan_round_trips_and_passes_the_runtimes_checks():
    plan = plan_placement(RESNET, ALL_DPU, BF3, host_assist=True)
    assert 0 < physical.host_share(plan, plan.stages[0]) < 1
    again = Plan.from_json(plan.to_json())
    assert again == plan
    physical.check(again)
    plain = plan_placement(RESNET, ALL_DPU, BF3)
    assert plan.predicted.throughput_per_s > plain.predicted.throughput_per_s
    assert plan.predicted.host_cpu_ms_per_item > plain.predicted.host_cpu_ms_per_item


def test_host_assist_on_a_placement_that_starts_on_the_host_is_refused():
    with pytest.raises(PlanError, match="first stage is a DPU stage"):
        plan_placement(RESNET, ALL_HOST, BF3, host_assist=True)


@pytest.mark.parametrize(
    ("share", "why"),
    [("yes", "must be a number"), (1.0, "from 0 up to 1"), (-0.1, "from 0 up to 1")],
)
def test_a_hand_edited_host_share_out_of_range_is_refused(share, why):
    plan = plan_placement(RESNET, ALL_DPU, BF3, host_assist=True)
    entry = {**plan.physical["s0-dpu0"], "host_share": share}
    bad = Plan.from_json({**plan.to_json(), "physical": {"s0-dpu0": entry}})
    with pytest.raises(PlanError, match=why):
        physical.check(bad)


def test_a_host_share_on_a_later_stage_is_refused():
    mixed = {"decode": "dpu0", "resize": "cpu", "crop": "dpu0", "norm": "cpu"}
    plan = plan_placement(RESNET, mixed, BF3)
    later = plan.stages[2].name
    entry = {**plan.physical[later], "host_share": 0.5}
    bad = Plan.from_json({**plan.to_json(), "physical": {**plan.physical, later: entry}})
    with pytest.raises(PlanError, match="first stage only"):
        physical.check(bad)


def test_the_general_path_refuses_a_plan_with_host_assist():
    mixed = {"decode": "dpu0", "resize": "cpu", "crop": "dpu0", "norm": "cpu"}
    plan = physical.with_host_share(plan_placement(RESNET, mixed, BF3), 0.5)
    with pytest.raises(PlanError, match="host assist is run for a plan of"):
        Chain(RESNET, plan, workers=1)


def variant(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_node_pinned_to_the_dpu_is_never_assisted_by_the_host(tmp_path):
    doc = yaml.safe_load((ROOT / "pipelines" / "resnet50.yaml").read_text())
    doc.pop("slo", None)
    doc["placement"] = {"decode": ["dpu"]}
    pinned = load_pipeline(variant(tmp_path, "p.yaml", yaml.safe_dump(doc, sort_keys=False)))
    plan = plan_for(pinned, BF3, host_assist=True)
    assert plan.placement["decode"] == "dpu0"
    assert not physical.host_share(plan, plan.stages[0])


def test_a_host_whose_memory_cannot_hold_the_stages_copy_is_not_assisted(tmp_path):
    text = BF3.read_text()
    assert "memory: 512GiB" in text
    small = variant(tmp_path, "t.yaml", text.replace("memory: 512GiB", "memory: 250MB"))
    plan = plan_for(RESNET, small, host_assist=True)
    assert not any(physical.host_share(plan, s) for s in plan.stages)


def test_host_assist_pinned_where_the_host_has_no_room_is_refused(tmp_path):
    text = BF3.read_text()
    assert "cores: 8, memory: 512GiB" in text and "cores: 16, memory: 32GiB" in text
    busy = variant(
        tmp_path,
        "t.yaml",
        text.replace("cores: 8, memory: 512GiB", "cores: 1, memory: 512GiB").replace(
            "cores: 16, memory: 32GiB", "cores: 64, memory: 32GiB"
        ),
    )
    decode_only = {"decode": "dpu0", "resize": "cpu", "crop": "cpu", "norm": "cpu"}
    with pytest.raises(PlanError, match="no room beside"):
        plan_placement(RESNET, decode_only, busy, host_assist=True)


def test_a_plans_share_is_one_the_runtime_starts_from():
    for topology in sorted((ROOT / "pipelines" / "topologies").glob("*.yaml")):
        plan = plan_for(RESNET, topology, host_assist=True)
        share = physical.host_share(plan, plan.stages[0])
        assert share == 0 or assist.SHARE_MIN <= share <= assist.SHARE_MAX, topology.name


def test_plan_says_its_load_table_is_the_placement_without_host_assist():
    from typer.testing import CliRunner

    from nicoffload.cli import build_app

    args = ["plan", "pipelines/resnet50.yaml", "--topology", str(BF3), "--host-assist"]
    result = CliRunner().invoke(build_app(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "load per item of this placement without host assist" in result.output
    assert "host assist: the host runs stage 's0-dpu0'" in result.output
