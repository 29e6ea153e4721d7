"""The plan shapes this runtime runs, and the best plan of those shapes.

A plan's stages are runs of consecutive nodes (topological order) on one device. The executor
runs [one DPU stage, served by its agent] + host CPU stages + [one GPU stage, last]: a plan that
goes back from the GPU to the host, or that puts a DPU stage after the host, is not runnable yet.
`best_runnable` finds the best placement of a runnable shape exactly: for every cut of the
topological order into a DPU prefix (on one DPU), host CPU nodes and a GPU suffix (on one GPU),
the solver's best placement under that restriction; then the best of those.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import Goal, best_row, evaluate
from nicoffload.planner.plan import device_kind


def stage_kinds(model: CostModel, placement: Sequence[int]) -> list[str]:
    """The device kind of each stage of a placement (device index per node, topological order)."""
    runs = [d for i, d in enumerate(placement) if i == 0 or placement[i - 1] != d]
    return [device_kind(model.devices[d]) for d in runs]


def runnable(model: CostModel, placement: Sequence[int]) -> bool:
    """Whether the executor runs this placement: [dpu] cpu* [gpu]."""
    kinds = stage_kinds(model, placement)
    lo = 1 if kinds and kinds[0] == "dpu" else 0
    hi = len(kinds) - 1 if len(kinds) > lo and kinds[-1] == "gpu" else len(kinds)
    return all(k == "cpu" for k in kinds[lo:hi])


def best_runnable(
    model: CostModel, goal: Goal, allowed: np.ndarray, time_limit: float = 20.0
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The best runnable placement and the best other runnable one (None when there is none)."""
    from nicoffload.planner.solve import solve

    n, kinds = model.n, np.array([device_kind(d) for d in model.devices])
    dpus, gpus = np.flatnonzero(kinds == "dpu"), np.flatnonzero(kinds == "gpu")
    on_cpu = kinds == "cpu"
    found: dict[bytes, np.ndarray] = {}
    for i in range(n + 1):  # nodes [0, i) on one DPU
        for j in range(i, n + 1):  # [i, j) on host CPUs, [j, n) on one GPU
            for dpu in dpus if i else [None]:
                for gpu in gpus if j < n else [None]:
                    mask = allowed.copy()
                    if i:
                        mask[:i] &= np.arange(len(kinds)) == dpu
                    mask[i:j] &= on_cpu
                    if j < n:
                        mask[j:] &= np.arange(len(kinds)) == gpu
                    if not mask.any(axis=1).all():
                        continue
                    p = solve(model, goal, mask, time_limit=time_limit)
                    if p is not None and runnable(model, p):
                        found[np.asarray(p, np.int8).tobytes()] = np.asarray(p)
    if not found:
        return None, None
    P = np.array(list(found.values()))
    first = best_row(evaluate(model, P), goal)
    if first is None:
        return None, None
    rest = np.delete(P, first, axis=0)
    second = best_row(evaluate(model, rest), goal) if len(rest) else None
    return P[first], (None if second is None else rest[second])
