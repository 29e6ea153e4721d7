"""Where the runtime's general path holds the interpreter less per item than its fast path (a
measured profile may say so: the 2-core VM's host 0.052 ms against 0.167), the MILP must still
price a placement of the fast path's shape at the fast path's figure: its general-path binary
was only bounded below, so the solver set it for a fast-shaped plan to pay the cheaper figure
(CLIP on the local topology, serial x20: all on the host, 296 items/s, over all on the DPU's
472). Random models as in test_planner_serial_exact, the general path's figure 0.2-1x the
fast path's."""

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
from nicoffload.planner.milp import solve_milp, solve_nodes

FEWER = settings(max_examples=40, deadline=None, derandomize=True)


def with_cheaper_general(model: CostModel, seed: int) -> CostModel:
    rng = np.random.default_rng(seed ^ 0xC4EA9)
    D = len(model.devices)
    names = [d.rstrip("0123456789") for d in model.devices]
    serial = np.zeros((2, D))
    for d in range(D):
        if model.host[d] or names[d] == "gpu":
            serial[0, d] = rng.uniform(0.5, 3.0)
            serial[1, d] = serial[0, d] * rng.uniform(0.2, 1.0)
    return dataclasses.replace(model, serial=serial, kinds=tuple(names))


@FEWER
@given(SEEDS)
def test_the_per_node_milp_prices_a_fast_shaped_plan_at_the_fast_figure(seed: int) -> None:
    model = with_cheaper_general(random_model(seed) if seed % 2 else random_branches(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


@FEWER
@given(SEEDS)
def test_parallel_chains_price_a_fast_shaped_plan_at_the_fast_figure(seed: int) -> None:
    model = with_cheaper_general(random_branches(seed), seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)
