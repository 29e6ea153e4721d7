"""planner/highs.py hands HiGHS what scipy's milp hands it and reads back what milp's result
holds: the same status, message, solution and bounds, on LPs and MILPs, optimal, infeasible
and stopped at a node limit; without scipy's HiGHS module it is milp."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import random as sparse_random

from nicoffload.planner import highs
from nicoffload.planner.flow import stopped_at_limit


def _knapsacks(seed: int, n: int = 60, m: int = 25):
    """Random covering and packing rows over n columns, a cost to minimize."""
    rng = np.random.default_rng(seed)
    A = sparse_random(m, n, density=0.3, random_state=seed, format="csr") * 10
    lo = np.where(rng.random(m) < 0.5, rng.uniform(1, 6, m), -np.inf)
    hi = np.where(np.isfinite(lo), np.inf, rng.uniform(4, 12, m))
    c = rng.uniform(-1, 2, n)
    return c, A, lo, hi, np.zeros(n), rng.integers(1, 4, n).astype(float)


def _same(a, b) -> None:
    assert (a.status, a.message) == (b.status, b.message)
    assert (a.x is None) == (b.x is None)
    if a.x is not None:
        assert np.array_equal(a.x, b.x) and a.fun == b.fun
    for key in ("mip_node_count", "mip_dual_bound", "mip_gap"):
        assert getattr(a, key, None) == getattr(b, key, None), key


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["lp", "milp", "nodes", "no-presolve"])
def test_program_returns_what_milp_returns(seed: int, kind: str) -> None:
    c, A, lo, hi, lb, ub = _knapsacks(seed)
    integrality = np.zeros(len(c)) if kind == "lp" else np.ones(len(c))
    options = {"mip_rel_gap": 1e-9, "time_limit": 60.0, "presolve": kind != "no-presolve"}
    if kind == "nodes":
        options["node_limit"] = 1
    want = milp(
        c,
        constraints=[LinearConstraint(A, lo, hi)],
        integrality=integrality,
        bounds=Bounds(lb, ub),
        options=dict(options),
    )
    program = highs.Program(A, lo, hi)
    for _ in range(2):  # the program's model is kept between runs
        got = program.run(c, lb, ub, integrality, options)
        _same(want, got)
        assert stopped_at_limit(want) == stopped_at_limit(got)


def test_infeasible() -> None:
    A = np.array([[1.0, 1.0]])
    got = highs.Program(A, [3.0], [np.inf]).run(np.ones(2), 0.0, 1.0, np.ones(2), {})
    assert got.status == 2 and got.x is None


def test_without_scipys_highs_module_it_is_milp(monkeypatch) -> None:
    c, A, lo, hi, lb, ub = _knapsacks(3)
    options = {"presolve": False, "mip_heuristic_run_feasibility_jump": False}
    want = highs.Program(A, lo, hi).run(c, lb, ub, np.ones(len(c)), options)
    monkeypatch.setattr(highs, "_core", None)
    got = highs.Program(A, lo, hi).run(c, lb, ub, np.ones(len(c)), options)
    assert got.status == want.status == 0
    assert np.isclose(got.fun, want.fun)
