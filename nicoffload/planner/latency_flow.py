"""A lower bound of the least latency of parallel chains under load caps: the LP relaxation of
that problem as one program, where the search (parallel.py) bisects the latencies paths can have.

A chain's latency is the largest, over its positions with outputs, of the time to finish that
position plus its outputs' delivery (`Chains.latency`), a sum over the path's arcs. A class's
flow sums it over its copies, and the longest copy takes at least their mean: copies * L >= that
sum, a row per position with outputs (for a class of one copy, its latency exactly). Every
placement under the caps is a solution with L its latency, so the LP's optimum bounds the least
latency from below; on 12 camera branches of 12 resolutions it is that latency (the bisection's
dozen probes under it then prove nothing new).
"""

from __future__ import annotations

import numpy as np

from nicoffload.planner.flow import FlowProblem, highs_quiet


def _outputs(ch) -> np.ndarray:
    """Positions (0..length-1) whose states deliver outputs (finite exit)."""
    at = np.flatnonzero(np.isfinite(ch.exit))
    pos = np.full(ch.n_states, -1)
    pos[ch.head] = ch.pos
    return np.unique(pos[at])


def latency_bound(problem: FlowProblem, t_cap: float, h_cap: float, time_limit: float) -> float:
    """A proven lower bound of the least latency under the caps: the LP relaxation of the
    least-latency problem (solved without presolve, so its bound holds); -inf when the LP did not
    finish, inf when it is infeasible. `problem` must be built without a latency bound (its
    graphs are the chains' own)."""
    from scipy.sparse import coo_matrix, csr_matrix, hstack, vstack

    from nicoffload.planner import highs

    if problem.empty:
        return np.inf
    nv = problem.nv
    L = nv
    # rows in units where the latency is at most about 1000, as the load rows (flow.row_scale):
    # HiGHS's 1e-6 row tolerance is then well inside REL_TOL
    scale = 1e3 / max(_longest(ch) for ch in problem.classes)
    rows: list[tuple[list[int], list[float], float]] = []  # coefficients >= lower
    for c, ch in enumerate(problem.classes):
        arcs = problem.offsets[c] + np.arange(len(ch.tail))
        for i in _outputs(ch):
            sel = np.flatnonzero(ch.pos <= i)
            coef = ch.time[sel].copy()
            at = ch.pos[sel] == i
            coef[at] += ch.exit[ch.head[sel[at]]]
            # the copies' flow: their latencies summed, at most copies * L
            rows.append(([L, *arcs[sel]], [float(ch.copies), *(-coef * scale)], 0.0))
    extra = 1
    ri = [r for r, (cols, _, _) in enumerate(rows) for _ in cols]
    ci = [col for cols, _, _ in rows for col in cols]
    vals = [v for _, vs, _ in rows for v in vs]
    B = coo_matrix((vals, (ri, ci)), shape=(len(rows), nv + extra))
    A = vstack([hstack([problem.A, csr_matrix((problem.A.shape[0], extra))]), B]).tocsr()
    lo = np.r_[problem.lo, [r[2] for r in rows]]
    hi = np.r_[problem.hi, np.full(len(rows), np.inf)]
    lb, ub, _ = problem.bounds(t_cap, h_cap)
    c = np.zeros(nv + extra)
    c[L] = 1.0
    # without presolve: quicker here (0.08 against 0.22 s on the 50-node bench's 12 camera
    # resolutions), and the bound then rests on no presolve at all
    options = {"time_limit": max(time_limit, 0.005), "presolve": False}
    with highs_quiet():
        res = highs.Program(A, lo, hi).run(
            c, np.r_[lb, 0.0], np.r_[ub, np.inf], np.zeros(nv + extra), options
        )
    if res.status == 2:
        return np.inf
    return float(res.fun) / scale if res.status == 0 else -np.inf


def _longest(ch) -> float:
    """More than any path's latency: the rows' unit."""
    per = np.zeros(ch.length + 1)
    np.maximum.at(per, ch.pos, np.maximum(ch.time, 0.0))
    ex = ch.exit[np.isfinite(ch.exit)]
    return float(per.sum() + (ex.max() if len(ex) else 0.0)) * 2 + 1.0
