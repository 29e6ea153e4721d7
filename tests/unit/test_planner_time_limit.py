"""A plan cut short by its time limit: the gap its note claims is proven (the optimum is within
it), and a runner-up that was not searched says so instead of calling itself infeasible."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.planner.cost import Catalog
from nicoffload.planner.evaluate import Goal, evaluate
from nicoffload.planner.milp import solve_milp
from nicoffload.planner.shapes import runnable
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
@pytest.mark.parametrize("limit", [0.3, 1.0])
def test_a_cut_short_plan_claims_no_more_than_is_proven(instance, objective: str, limit) -> None:
    """Its note's gap is a proof: nothing, found however much later, beats the plan by more.
    A plan without the note is optimal: nothing beats it at all."""
    pipeline, topology, model, cache = instance
    plan = plan_for(pipeline, topology, objective=objective, catalog=CATALOG, time_limit_s=limit)
    mine = evaluate(model, _placement(model, plan)[None, :])
    later = _longer(model, objective, cache)
    primary, secondary = KEYS[objective]
    notes = " ".join(plan.notes)
    claim = re.search(r"this plan is proven within ([0-9.]+)% of the optimum", notes)
    gap = float(claim[1]) / 100 if claim else 0.0
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
    pipeline, topology, _, _ = instance
    plan = plan_for(pipeline, topology, catalog=CATALOG, explain=True, time_limit_s=0.3)
    ex = plan.explain
    if ex["runner_up"] is None:
        assert ex["runner_up_missing"].startswith(("not searched", "none found in the"))


def _placement(model, plan):
    import numpy as np

    return np.array([model.devices.index(plan.placement[n]) for n in model.nodes])


def test_a_runnable_search_cut_short_says_how_much_it_searched(instance) -> None:
    """A 12-branch DAG can take hundreds of thousands of runnable shapes: the search stops at
    the limit and says how many it solved, instead of running for hours."""
    pipeline, topology, model, _ = instance
    plan = plan_for(pipeline, topology, catalog=CATALOG, time_limit_s=2.0, runnable=True)
    (note,) = [n for n in plan.notes if "the runnable search solve" in n]
    searched, shapes = map(int, re.findall(r"solve (\d+) of the (\d+) shapes", note)[0])
    assert 0 < searched < shapes
    assert runnable(model, _placement(model, plan))
