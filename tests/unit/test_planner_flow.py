"""The flow problem's searches that the staged search (parallel.py) relies on: `find` with an
objective ("is anything better?") returns the optimum (counts routed within the optimum of
the relaxation, or the whole MILP decides) and refutes a cap below it; `near` keeps a start's
counts at the positions it pins and never claims a refutation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_properties import SEEDS, _random_paths, random_branches

from nicoffload.planner.branches import chain_classes
from nicoffload.planner.evaluate import REL_TOL, evaluate
from nicoffload.planner.flow import FlowProblem, placement


def _problem(seed: int) -> tuple:
    """A random property instance, its chain classes and their flow problem, unbounded."""
    model = random_branches(seed)
    classes = chain_classes(model)
    return model, classes, FlowProblem(model, classes, [None] * len(classes), np.inf)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(SEEDS)
def test_find_with_an_objective_returns_the_least_load_under_the_cap(seed: int) -> None:
    problem = _problem(seed)[2]
    truth = problem.solve("T")
    got = problem.find(np.inf, np.inf, 10.0, "T")
    assert got.status == truth.status
    if truth.status == "infeasible":  # memory limits no placement meets
        return
    assert got.status == "optimal"
    assert got.t == pytest.approx(truth.value, rel=1e-6)
    assert got.bound == pytest.approx(truth.value, rel=1e-6)
    assert problem.find(truth.value * (1 - 10 * REL_TOL), np.inf, 10.0, "T").status == (
        "infeasible"
    )


@settings(max_examples=50, deadline=None, derandomize=True)
@given(SEEDS)
def test_near_keeps_the_pinned_counts_of_its_start_and_refutes_nothing(seed: int) -> None:
    model, classes, problem = _problem(seed)
    rng = np.random.default_rng(seed)
    start = _random_paths(model, rng)
    heavy = [rng.random(ch.length) < 0.5 for ch in classes]
    m0 = evaluate(model, placement(model, classes, start)[None, :])
    cap = float(m0.bottleneck[0]) * rng.uniform(0.8, 1.2)
    got = problem.near(start, heavy, cap, np.inf, 10.0)
    assert got.status != "infeasible"
    if got.paths is None:
        return
    assert got.t <= cap * (1 + 1e-6)
    for ch, rows, mine, pinned in zip(classes, start, got.paths, heavy, strict=True):
        for i in np.flatnonzero(pinned):
            want = np.bincount(ch.dev[rows[:, i]], minlength=len(model.devices))
            assert np.array_equal(np.bincount(ch.dev[mine[:, i]], minlength=len(want)), want)
