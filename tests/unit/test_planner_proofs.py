"""The staged search (parallel.py) claims optimality only on refutations it has re-checked
without HiGHS's MIP presolve, which can call a feasible problem infeasible (ERGO-Code/HiGHS#2388)."""

from __future__ import annotations

import pytest
from test_planner_properties import _primary, random_branches, random_goal

from nicoffload.planner import parallel
from nicoffload.planner.evaluate import brute_force
from nicoffload.planner.milp import solve_milp


def test_a_false_infeasible_from_presolve_does_not_become_an_optimality_proof(monkeypatch):
    """With no direct solve, presolve calls the relaxation capped at 0.73957 ms infeasible
    (the optimum is 0.5941): the decisive refutation, re-checked, finds the better packing."""
    monkeypatch.setattr(parallel, "DIRECT_NODES", 0)
    model = random_branches(2150332)
    goal = random_goal(model, 2150332)
    truth = _primary(model, goal, brute_force(model, goal)[0])
    got = solve_milp(model, goal)
    assert got.status == "optimal" and got.gap == 0
    assert _primary(model, goal, got.placement) == pytest.approx(truth, rel=1e-6, abs=1e-9)
