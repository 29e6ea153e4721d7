"""A node's load on another resource (`CostModel.side`): a GPU decoder's progressive JPEGs are
decoded on the Session host's threads. The cost model prices that host CPU and only the rest
on the GPU; every solver stays exact with such loads (brute force on random models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_properties import (
    SEEDS,
    _agrees_with_brute_force,
    random_branches,
    random_goal,
    random_model,
)

from nicoffload.graph import load_pipeline, with_typical
from nicoffload.planner.cost import Catalog, CostModel, build_model
from nicoffload.planner.dp import solve_chain
from nicoffload.planner.evaluate import evaluate
from nicoffload.planner.milp import solve_milp, solve_nodes
from nicoffload.planner.solve import resolve_profiles, resolve_topology

ROOT = Path(__file__).resolve().parents[2]


def _model(progressive: float, host_decoded: float = 0.0) -> CostModel:
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    t = dict(pipeline.inputs["image"].hints)
    typical = {"height": t["height"], "width": t["width"], "bytes": 110_000}
    if progressive:
        typical["progressive"] = progressive
    if host_decoded:
        typical["host_decoded"] = host_decoded
    pipeline = with_typical(pipeline, {"image": typical})
    topo = resolve_topology(ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml")
    return build_model(pipeline, topo, resolve_profiles(topo), Catalog.from_registry())


def test_a_gpu_decoders_progressive_share_is_host_cpu_and_the_rest_gpu_time() -> None:
    base, mixed = _model(0.0), _model(0.25)
    v, gpu, cpu = base.nodes.index("decode"), base.devices.index("gpu0"), base.devices.index("cpu")
    assert base.side == ()
    assert mixed.cost[v, gpu] == base.cost[v, gpu] * 0.75
    ((sv, sd, k, ms),) = mixed.side
    assert (sv, sd, k) == (v, gpu, cpu) and ms > 0
    all_gpu = np.full((1, base.n), gpu)
    extra = evaluate(mixed, all_gpu).host[0] - evaluate(base, all_gpu).host[0]
    assert extra == ms  # the all-GPU plan's host CPU grows by the host's progressive decodes
    on_cpu = all_gpu.copy()
    on_cpu[0, v] = cpu  # a CPU decoder pays its progressive share on itself, no side load
    assert evaluate(mixed, on_cpu).work[0, gpu] < evaluate(mixed, all_gpu).work[0, gpu]


def test_files_the_gpu_leaves_to_the_host_are_priced_there_at_their_kind() -> None:
    """A quarter progressive and another quarter gray: half the decodes are the host's, the
    progressive ones at its progressive ratio, the gray ones at its baseline figure."""
    base, prog, both = _model(0.0), _model(0.25), _model(0.25, 0.5)
    v, gpu = base.nodes.index("decode"), base.devices.index("gpu0")
    assert both.cost[v, gpu] == base.cost[v, gpu] * 0.5
    (progressive_ms,) = [ms for *_, ms in prog.side]
    (all_ms,) = [ms for *_, ms in both.side]
    host = resolve_profiles(
        resolve_topology(ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml")
    )["cpu"]
    baseline_quarter = all_ms - progressive_ms
    x = host.kernels["decode_image"].progressive_x or 1.0  # the shipped estimate has none
    assert baseline_quarter > 0 and progressive_ms == pytest.approx(baseline_quarter * x)


def with_side(model: CostModel, seed: int) -> CostModel:
    """`model` with random loads of some (node, device) pairs on other devices' resources."""
    rng = np.random.default_rng(seed ^ 0x51DE)
    D = len(model.devices)
    side = []
    for v in range(model.n):
        for d in range(D):
            if np.isfinite(model.cost[v, d]) and rng.random() < 0.3:
                side.append((v, d, int(rng.integers(0, D)), float(rng.uniform(0.01, 3.0))))
    return dataclasses.replace(model, side=tuple(side))


FEWER = settings(max_examples=30, deadline=None, derandomize=True)


@FEWER
@given(SEEDS)
def test_the_milp_is_exact_with_side_loads(seed: int) -> None:
    model = with_side(random_model(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


@FEWER
@given(SEEDS)
def test_parallel_chains_are_exact_with_side_loads(seed: int) -> None:
    model = with_side(random_branches(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@FEWER
@given(SEEDS)
def test_the_chain_dp_is_exact_with_side_loads(seed: int) -> None:
    model = with_side(random_model(seed, chain=True), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_chain(model, goal))
