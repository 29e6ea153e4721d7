"""Ties of a proven plan: a placement one move from it (a node on another device, or two
devices' nodes swapped) that is as good on the objective and its tie-break. Of a plan proven
optimal nothing is better, so such a placement is its runner-up, found without a search.
"""

from __future__ import annotations

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import REL_TOL, Goal, evaluate

# evaluate's cost per call grows with nodes x tensors (1.3 s CPU for the 200-node bench, whose
# runner-up search takes 0.1 s): past this many nodes the runner-up is searched for instead
MAX_NODES = 100


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
    tie-break (within REL_TOL, as every solver judges), or None when none does (or the
    model has more than MAX_NODES nodes)."""
    if model.n > MAX_NODES:
        return None
    P = neighbours(best, allowed)
    if not len(P):
        return None
    m = evaluate(model, np.concatenate([best[None, :], P]))  # one call: its loops are per call
    primary, secondary = m.keys(goal.objective)

    def within(x: np.ndarray, of: float) -> np.ndarray:
        return x <= of + abs(of) * REL_TOL + 1e-12

    tied = (
        m.feasible(goal)
        & within(primary, float(primary[0]))
        & within(secondary, float(secondary[0]))
    )
    tied[0] = False
    if not tied.any():
        return None
    rows = np.flatnonzero(tied)  # as best_row orders them: the least primary, then secondary
    low = primary[rows].min()
    rows = rows[primary[rows] <= low + abs(low) * REL_TOL + 1e-12]
    return P[rows[np.argmin(secondary[rows])] - 1]
