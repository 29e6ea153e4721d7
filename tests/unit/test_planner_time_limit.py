"""A plan cut short by its time limit: the gap its note claims is proven (the optimum is within
it), and a runner-up that was not searched says so instead of calling itself infeasible."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nicoffload.errors import PlanError
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.planner.cost import Catalog
from nicoffload.planner.evaluate import Goal, evaluate
from nicoffload.planner.milp import solve_milp
from nicoffload.planner.solve import build_model, resolve_profiles
from nicoffload.topology import load_topology

OPS = ("decode_image", "resize", "center_crop", "normalize")
CATALOG = Catalog(
    {**{op: frozenset({"cpu", "dpu", "gpu"}) for op in OPS}, "tokenize": frozenset({"cpu", "dpu"})}
)


def _write(tmp: Path, branches: int) -> tuple[Path, Path]:
    """Camera and caption branches on two sockets with two DPUs and four GPUs each."""
    lines = ["name: cams", "inputs:"]
    for i in range(branches):
        lines.append(
            f"  img{i}: {{kind: bytes, format: jpeg, typical: {{height: 375, width: 500, bytes: 110000}}}}"
        )
        lines.append(f"  txt{i}: {{kind: text, typical: {{chars: 300}}}}")
    lines.append("nodes:")
    outs = []
    for i in range(branches):
        lines += [
            f"  - {{name: dec{i}, op: decode_image, in: img{i}}}",
            f"  - {{name: rs{i}, op: resize, in: dec{i}, params: {{shorter: 256}}}}",
            f"  - {{name: cr{i}, op: center_crop, in: rs{i}, params: {{size: 224}}}}",
            f"  - {{name: nm{i}, op: normalize, in: cr{i}, params: {{mean: [0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2]}}}}",
            f"  - {{name: tk{i}, op: tokenize, in: txt{i}, params: {{max_length: 128}}}}",
        ]
        outs += [f"  px{i}: nm{i}", f"  ids{i}: tk{i}.input_ids"]
    (tmp / "p.yaml").write_text("\n".join([*lines, "outputs:", *outs, ""]))
    devs = [
        "  cpu0: {kind: cpu, cores: 16, profile: x86-server}",
        "  cpu1: {kind: cpu, cores: 16, profile: x86-server}",
    ]
    links = ["  - {between: [cpu0, cpu1], transport: shm, bandwidth: 40GB/s}"]
    for i in range(4):
        devs.append(f"  dpu{i}: {{kind: dpu, cores: 16, profile: bluefield3-arm}}")
        links.append(f"  - {{between: [dpu{i}, cpu{i // 2}], transport: rdma, bandwidth: 400Gb/s}}")
    for i in range(8):
        devs.append(f"  gpu{i}: {{kind: gpu, profile: h100}}")
        links.append(f"  - {{between: [gpu{i}, cpu{i // 4}], transport: pcie, bandwidth: 64GB/s}}")
    top = [
        "name: two-socket",
        "ingress: dpu0",
        "egress: gpu0",
        "devices:",
        *devs,
        "links:",
        *links,
        "",
    ]
    (tmp / "t.yaml").write_text("\n".join(top))
    return tmp / "p.yaml", tmp / "t.yaml"


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    """12 branches over 2 sockets, 4 DPUs and 8 GPUs: a load stage that takes seconds to
    close (its first packings are 7% over the optimum), so short limits cut it mid-way."""
    p, t = _write(tmp_path_factory.mktemp("cams"), 12)
    pipeline, topology = load_pipeline(p), load_topology(t)
    model = build_model(pipeline, topology, resolve_profiles(topology), CATALOG)
    return pipeline, topology, model, {}


def _longer(model, objective: str, cache: dict):
    """A placement from a longer search (not necessarily proven): what any claim must allow."""
    if objective not in cache:
        cache[objective] = solve_milp(model, Goal(objective), time_limit=10.0).placement
    return evaluate(model, cache[objective][None, :])


KEYS = {"throughput": ("bottleneck", "latency"), "host-cpu": ("host", "bottleneck")}


@pytest.mark.parametrize("objective", ["throughput", "host-cpu"])
@pytest.mark.parametrize("limit", [0.6, 1.5])
def test_a_cut_short_plan_claims_no_more_than_is_proven(instance, objective: str, limit) -> None:
    """Its note's gap is a proof: nothing, found however much later, beats the plan by more.
    A plan without the note is optimal: nothing beats it at all."""
    pipeline, topology, model, cache = instance
    try:
        plan = plan_for(
            pipeline, topology, objective=objective, catalog=CATALOG, time_limit_s=limit
        )
    except PlanError as exc:  # a loaded machine: nothing found yet, and it says only that
        assert "found no placement in its" in str(exc)
        return
    mine = evaluate(model, _placement(model, plan)[None, :])
    later = _longer(model, objective, cache)
    primary, secondary = KEYS[objective]
    notes = " ".join(plan.notes)
    if "before it proved any bound" in notes:
        return  # it claims nothing
    claim = re.search(r"this plan is proven within ([0-9.]+)% of the optimum", notes)
    gap = float(claim[1]) / 100 if claim else 0.0
    assert plan.search["gap"] == pytest.approx(gap, abs=5e-4)  # --json says it too
    if claim:  # only the time limit cuts a search, and the plan says it did
        assert plan.search["stopped_at_time_limit"] is True
    ours, theirs = float(getattr(mine, primary)[0]), float(getattr(later, primary)[0])
    assert theirs >= ours * (1 - gap - 1e-3) - 1e-9, (notes, ours, theirs)
    if claim or theirs > ours * (1 + 1e-6) + 1e-9:
        return  # the secondary is compared only between plans that tie on the primary
    tie = re.search(r"its \S+ is proven only within ([0-9.]+)% of the best", notes)
    if "was not compared" in notes:
        return
    gap = float(tie[1]) / 100 if tie else 0.0
    ours, theirs = float(getattr(mine, secondary)[0]), float(getattr(later, secondary)[0])
    assert theirs >= ours * (1 - gap - 1e-3) - 1e-9, (notes, ours, theirs)


def test_a_runner_up_left_unsearched_says_so(instance) -> None:
    """Out of time before the runner-up: "not searched", never "no other placement is
    feasible", in --json and in the table."""
    from nicoffload.cli.plan import render
    from nicoffload.planner.explain import explanation
    from nicoffload.planner.solve import runner_up

    pipeline, topology, model, _ = instance
    plan = plan_for(pipeline, topology, catalog=CATALOG, time_limit_s=2.0)  # any plan will do
    best = _placement(model, plan)
    second, missing = runner_up(model, Goal("throughput"), best, model.allowed, 0.0)
    assert second is None and missing.startswith("not searched")
    ex = explanation(model, topology, Goal("throughput"), best, None, missing)
    assert ex["runner_up"] is None and ex["runner_up_missing"] == missing
    text = " ".join(str(part) for part in render(dataclasses.replace(plan, explain=ex)))
    assert f"runner-up: none ({missing})" in text


def test_a_search_out_of_time_is_not_called_infeasible(instance, monkeypatch) -> None:
    """A MILP that found nothing before its limit proves nothing: the error says to give it
    time, not that no placement meets the constraints."""
    from nicoffload.planner import milp

    pipeline, topology, _, _ = instance
    monkeypatch.setattr(
        milp, "solve_milp", lambda *a, **k: milp.MilpResult(None, "failed: time limit", 1.0, 0)
    )
    with pytest.raises(PlanError, match=r"found no placement in its 0\.5 s time limit"):
        plan_for(pipeline, topology, catalog=CATALOG, time_limit_s=0.5)


def _placement(model, plan):
    import numpy as np

    return np.array([model.devices.index(plan.placement[n]) for n in model.nodes])


def test_a_plan_cut_short_before_any_bound_claims_none(instance, monkeypatch) -> None:
    """A gap of 1 is no bound at all: the note says so, never "proven within 100.0%"."""
    from nicoffload.planner import milp

    pipeline, topology, model, cache = instance
    _longer(model, "throughput", cache)  # any placement will do
    cut = milp.MilpResult(cache["throughput"], "feasible", 1.0, 1, float("inf"))
    monkeypatch.setattr(milp, "solve_milp", lambda *a, **k: cut)
    plan = plan_for(pipeline, topology, catalog=CATALOG, time_limit_s=0.5)
    notes = " ".join(plan.notes)
    assert "stopped at its 0.5 s time limit before it proved any bound" in notes
    assert "proven within" not in notes
    assert plan.search["gap"] is None and plan.search["tie_break_gap"] is None
