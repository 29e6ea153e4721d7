"""The flow problem's `find` with an objective, which the staged load search (parallel.py)
asks "is anything better?" with: it returns the optimum (counts routed within the optimum of
the relaxation, or the whole MILP decides) and refutes a cap below it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_properties import SEEDS, random_branches

from nicoffload.planner.branches import chain_classes
from nicoffload.planner.evaluate import REL_TOL
from nicoffload.planner.flow import FlowProblem


@settings(max_examples=50, deadline=None, derandomize=True)
@given(SEEDS)
def test_find_with_an_objective_returns_the_least_load_under_the_cap(seed: int) -> None:
    model = random_branches(seed)
    classes = chain_classes(model)
    problem = FlowProblem(model, classes, [None] * len(classes), np.inf)
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
