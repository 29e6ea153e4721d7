"""The runner-up: the best placement other than the plan's, for explain. Of a plan proven
optimal, a placement that ties with it is the runner-up at once (ties.py, asked by solve_milp).
"""

from __future__ import annotations

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import Goal, best_row, evaluate

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
        result = solve_milp(model, goal, allowed, best, time_limit, exclude_optimal=proven)
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
