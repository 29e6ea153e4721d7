"""The least-latency LP (planner/latency_flow.py) bounds the least latency from below, and the
latency search that starts from it stays exact, against brute force on small random parallel
chains: classes of several copies and of one (mixed sizes), pins, memory caps, throughput
floors and latency SLOs."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import assume, given
from test_planner_properties import SEEDS, SETTINGS, random_branches, random_goal
from test_planner_shortcuts import mixed_chains

from nicoffload.planner.branches import chain_classes
from nicoffload.planner.evaluate import REL_TOL, Goal, brute_force, evaluate
from nicoffload.planner.milp import solve_milp
from nicoffload.planner.parallel import _Search


def _model(seed: int):
    return mixed_chains(seed) if seed % 2 else random_branches(seed)


def _least_latency_under(model, t_cap: float, h_cap: float) -> float | None:
    """The least latency of a placement within the caps and memory, by brute force."""
    choices = [np.flatnonzero(model.allowed[v]) for v in range(model.n)]
    grid = np.array(np.meshgrid(*choices, indexing="ij")).reshape(model.n, -1).T
    m = evaluate(model, grid)
    ok = m.ok & (m.bottleneck <= t_cap * (1 + REL_TOL)) & (m.host <= h_cap * (1 + REL_TOL))
    return float(m.latency[ok].min()) if ok.any() else None


@SETTINGS
@given(SEEDS)
def test_the_latency_lp_never_exceeds_the_least_latency_under_the_caps(seed: int) -> None:
    model = _model(seed)
    classes = chain_classes(model)
    assert classes is not None
    rng = np.random.default_rng(seed + 7)
    fast = brute_force(model, Goal("throughput"))
    assume(fast is not None)
    t_cap = float(fast[1].bottleneck[0]) * rng.choice([1.0, 1.3, np.inf])
    h_cap = float(fast[1].host[0]) * rng.choice([1.0, np.inf])
    truth = _least_latency_under(model, t_cap, h_cap)
    s = _Search(model, classes, time.perf_counter() + 60)
    bound = s.latency_bound(t_cap, h_cap)
    if truth is None:
        return  # nothing to bound (the LP may still be feasible: it is a relaxation)
    assert bound <= truth * (1 + 1e-6) + 1e-9


@SETTINGS
@given(SEEDS)
def test_the_latency_tie_break_of_parallel_chains_is_exact(seed: int) -> None:
    """Throughput's tie-break and the latency objective itself, the stages that start from the
    LP's bound, against brute force (classes of several copies included)."""
    model = _model(seed)
    slo = random_goal(model, seed)
    objective = "throughput" if seed % 3 else "latency"
    goal = Goal(objective, slo.min_throughput_per_s, slo.max_latency_ms)
    truth = brute_force(model, goal)
    result = solve_milp(model, goal)
    if truth is None:
        assert result.placement is None
        return
    assume(result.gap == 0 and result.tie_gap == 0)
    got = evaluate(model, result.placement[None, :])
    assert got.feasible(goal)[0]
    got_keys, want = got.keys(goal.objective), truth[1].keys(goal.objective)
    assert got_keys[0][0] == pytest.approx(want[0][0], rel=1e-6, abs=1e-9)
    # ties within REL_TOL on the primary may order the secondary either way
    assume(abs(got_keys[0][0] - want[0][0]) <= 1e-9 * max(1.0, abs(want[0][0])))
    assert got_keys[1][0] == pytest.approx(want[1][0], rel=1e-6, abs=1e-9)
