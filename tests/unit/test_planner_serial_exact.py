"""The host process's serial (GIL-held) time in the exact solvers: with it in the cost model,
every solver's plan is still the brute force's best (it caps throughput, so a plan that
ignored it could be several times slower than the best and still be called optimal, or meet
a throughput SLO on paper only). Random models as in test_planner_properties, each given a
serial term on its host and GPU devices, on both the runtime's paths (fast and general)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from test_planner_properties import (
    SEEDS,
    _agrees_with_brute_force,
    random_branches,
    random_goal,
    random_model,
)

from nicoffload.planner.cost import CostModel
from nicoffload.planner.dp import solve_chain
from nicoffload.planner.milp import solve_milp, solve_nodes
from nicoffload.planner.solve import solve

FEWER = settings(max_examples=40, deadline=None, derandomize=True)  # the suite's time: 4 x ~5 s


def with_serial(
    model: CostModel,
    seed: int,
    kinds: bool = True,
    *,
    fast: tuple[float, float] = (0.0, 3.0),
    general: tuple[float, float] = (1.0, 2.0),
    salt: int = 0x5E51A1,
) -> CostModel:
    """`model` with ms per item of serial time on its host and GPU devices (the fast path's
    drawn from `fast`), the general path's at `general` times the fast path's (1-2x), and (with
    `kinds`) its devices' kinds, so that the path depends on the placement's shape."""
    rng = np.random.default_rng(seed ^ salt)
    D = len(model.devices)
    names = [d.rstrip("0123456789") for d in model.devices]
    serial = np.zeros((2, D))
    for d in range(D):
        if model.host[d] or names[d] == "gpu":
            serial[0, d] = rng.uniform(*fast)
            serial[1, d] = serial[0, d] * rng.uniform(*general)
    return dataclasses.replace(model, serial=serial, kinds=tuple(names) if kinds else ())


@FEWER
@given(SEEDS)
def test_the_planner_matches_brute_force_with_the_hosts_serial_time(seed: int) -> None:
    model = with_serial(random_model(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve(model, goal))


@FEWER
@given(SEEDS)
def test_parallel_chains_match_brute_force_with_the_hosts_serial_time(seed: int) -> None:
    model = with_serial(random_branches(seed), seed, kinds=bool(seed % 2))
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(SEEDS)
def test_the_per_node_milp_prices_the_serial_time_on_any_dag(seed: int) -> None:
    model = with_serial(random_model(seed) if seed % 2 else random_branches(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


@FEWER
@given(SEEDS)
def test_the_chain_dp_matches_brute_force_with_the_hosts_serial_time(seed: int) -> None:
    model = with_serial(random_model(seed, chain=True), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_chain(model, goal))
