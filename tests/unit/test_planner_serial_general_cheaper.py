"""Where the runtime's general path holds the interpreter less per item than its fast path (a
measured profile may say so: the 2-core VM's host 0.052 ms against 0.167), the MILP must still
price a placement of the fast path's shape at the fast path's figure: its general-path binary
was only bounded below, so the solver set it for a fast-shaped plan to pay the cheaper figure
(CLIP on the local topology, serial x20: all on the host, 296 items/s, over all on the DPU's
472). Random models as in test_planner_serial_exact, the general path's figure 0.2-1x the
fast path's."""

from __future__ import annotations

from hypothesis import given, settings
from test_planner_properties import (
    SEEDS,
    _agrees_with_brute_force,
    random_branches,
    random_goal,
    random_model,
)
from test_planner_serial_exact import with_serial

from nicoffload.planner.cost import CostModel
from nicoffload.planner.milp import solve_milp, solve_nodes

FEWER = settings(max_examples=40, deadline=None, derandomize=True)


def with_cheaper_general(model: CostModel, seed: int) -> CostModel:
    return with_serial(model, seed, fast=(0.5, 3.0), general=(0.2, 1.0), salt=0xC4EA9)


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
