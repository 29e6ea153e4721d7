"""The runner-up: the best placement other than the plan's, for explain. A placement one move
from the plan that ties with it on the objective and its tie-break is the runner-up at once
(none can beat the plan, proven optimal); only when none ties is it searched for.
"""

from __future__ import annotations

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import REL_TOL, Goal, best_row, evaluate

INFEASIBLE = "no other placement is feasible"


def runner_up(
    model: CostModel,
    goal: Goal,
    best: np.ndarray,
    allowed: np.ndarray,
    time_limit: float = 60.0,
    proven: bool = False,
) -> tuple[np.ndarray | None, str | None]:
    """The best placement other than `best` (for a chain, the best over forcing one node
    elsewhere), and when there is none, why: none is feasible, or none was found in time.
    `proven`: `best` is proven optimal, objective and tie-break (a tie is then a runner-up)."""
    return search_runner_up(model, goal, best, allowed, time_limit, proven)[:2]


def search_runner_up(
    model: CostModel,
    goal: Goal,
    best: np.ndarray,
    allowed: np.ndarray,
    time_limit: float,
    proven: bool = False,
) -> tuple[np.ndarray | None, str | None, bool]:
    """runner_up, and whether the time limit cut its search."""
    if not is_chain(model):
        from nicoffload.planner.milp import solve_milp

        if time_limit <= 0:
            return None, "not searched: the time limit was spent on the plan", True
        if proven:
            tie = tied_neighbour(model, goal, best, allowed)
            if tie is not None:
                return tie, None, False
        result = solve_milp(model, goal, allowed, best, time_limit)
        if result.placement is not None:
            return result.placement, None, result.cut
        if result.status != "infeasible":
            return None, f"none found in the {time_limit:.2g} s left of the time limit", True
        return None, INFEASIBLE, result.cut
    found = []
    for v in range(model.n):
        for d in np.flatnonzero(allowed[v]):
            if d != best[v]:
                forced = allowed.copy()
                forced[v] = False
                forced[v, d] = True
                p = solve_chain(model, goal, forced)
                if p is not None:
                    found.append(p)
    if not found:
        return None, INFEASIBLE, False
    P = np.array(found)
    i = best_row(evaluate(model, P), goal)
    return (None, INFEASIBLE, False) if i is None else (P[i], None, False)


def neighbours(best: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The placements one move from `best` that `allowed` permits, in a fixed order: each node
    on each other device, then each two devices' nodes swapped (where that moves several)."""
    n, D = allowed.shape
    v, d = np.nonzero(allowed)
    keep = d != best[v]
    moves = np.repeat(best[None, :], int(keep.sum()), axis=0)
    moves[np.arange(len(moves)), v[keep]] = d[keep]
    used = np.unique(best)
    swaps = []
    for a in used:
        for b in range(D):
            if b != a and not (b in used and b < a):
                p = np.where(best == a, b, np.where(best == b, a, best))
                if (p != best).sum() > 1 and allowed[np.arange(n), p].all():  # one: a move
                    swaps.append(p)
    return np.concatenate([moves, np.array(swaps, np.intp).reshape(-1, n)])


def tied_neighbour(
    model: CostModel, goal: Goal, best: np.ndarray, allowed: np.ndarray
) -> np.ndarray | None:
    """The best of the neighbours of `best` that tie with it on the objective and its
    tie-break (within REL_TOL, as every solver judges), or None when none does."""
    P = neighbours(best, allowed)
    if not len(P):
        return None
    m = evaluate(model, P)
    ref = evaluate(model, best[None, :])
    (p_best, s_best), (p, s) = ref.keys(goal.objective), m.keys(goal.objective)

    def within(x: np.ndarray, of: float) -> np.ndarray:
        return x <= of + abs(of) * REL_TOL + 1e-12

    tied = m.feasible(goal) & within(p, float(p_best[0])) & within(s, float(s_best[0]))
    if not tied.any():
        return None
    rows = np.flatnonzero(tied)
    i = best_row(evaluate(model, P[rows]), goal)
    return None if i is None else P[rows[i]]
