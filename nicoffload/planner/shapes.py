"""The plan shapes this runtime runs, and the best plan of those shapes.

A plan's stages are runs of consecutive nodes (topological order) on one device. The executor
runs [one DPU stage, served by its agent] + host CPU stages + [one GPU stage, last]: a plan that
goes back from the GPU to the host, or that puts a DPU stage after the host, is not runnable yet.
`best_runnable` finds the best placement of a runnable shape: for every cut of the topological
order into a DPU prefix (on one DPU), host CPU nodes and a GPU suffix (on one GPU) that the
kernels allow, the solver's best placement under that restriction; then the best of those.
Exact when every cut is solved within the time limit; a large DAG has tens of thousands of
cuts, and the result then says how many were.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from nicoffload.errors import PlanError
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


@dataclass(frozen=True)
class Runnable:
    """The best runnable placement, the best other one (None when there is none), and how many
    of the shapes a placement can take (cuts into a DPU prefix on one DPU, host CPU nodes and a
    GPU suffix on one GPU) were solved before the time limit: all of them, each proven, makes
    it exact. `gaps`: what is proven of `best` among runnable placements, as the MILP's gaps
    (objective, tie-break): the largest any cut left; inf for a cut unsolved or unsearched."""

    best: np.ndarray | None
    second: np.ndarray | None
    shapes: int
    searched: int
    gaps: tuple[float, float] = (0.0, 0.0)


def best_runnable(
    model: CostModel, goal: Goal, allowed: np.ndarray, time_limit: float = 20.0
) -> Runnable:
    """The best placement of each shape the kernels allow, within `time_limit` for them all."""
    from nicoffload.planner.dp import is_chain, solve_chain
    from nicoffload.planner.milp import solve_milp

    deadline = time.perf_counter() + time_limit
    n, kinds = model.n, np.array([device_kind(d) for d in model.devices])
    dpus, gpus = np.flatnonzero(kinds == "dpu"), np.flatnonzero(kinds == "gpu")
    on_cpu = kinds == "cpu"
    cuts = list(_cuts(allowed, dpus, gpus, on_cpu))
    found: dict[bytes, np.ndarray] = {}
    searched, gap, tie, chain = 0, 0.0, 0.0, is_chain(model)
    for i, j, dpu, gpu in cuts:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        mask = allowed.copy()
        if i:
            mask[:i] &= np.arange(len(kinds)) == dpu
        mask[i:j] &= on_cpu
        if j < n:
            mask[j:] &= np.arange(len(kinds)) == gpu
        if chain:
            p = solve_chain(model, goal, mask)
        else:
            result = solve_milp(model, goal, mask, time_limit=left)
            p = result.placement
            solved = p is not None or result.status == "infeasible"
            gap = max(gap, result.gap if solved else np.inf)
            tie = max(tie, result.tie_gap if p is not None else 0.0)
        searched += 1
        if p is not None and runnable(model, p):
            found[np.asarray(p, np.int8).tobytes()] = np.asarray(p)
    gaps = (gap, tie) if searched == len(cuts) else (np.inf, np.inf)
    P = np.array(list(found.values()))
    first = best_row(evaluate(model, P), goal) if found else None
    if first is None:
        return Runnable(None, None, len(cuts), searched, gaps)
    rest = np.delete(P, first, axis=0)
    second = best_row(evaluate(model, rest), goal) if len(rest) else None
    return Runnable(P[first], None if second is None else rest[second], len(cuts), searched, gaps)


def _cuts(
    allowed: np.ndarray, dpus, gpus, on_cpu
) -> Iterator[tuple[int, int, int | None, int | None]]:
    """(i, j, dpu, gpu): nodes [0, i) on `dpu`, [i, j) on host CPUs, [j, n) on `gpu`, for every
    cut the kernels allow (the rest would leave a node nowhere to run), without building masks:
    a DPU prefix ends before the first node that DPU cannot run, a GPU suffix starts after the
    last one that GPU cannot, and host nodes run until one the host cannot."""
    n = len(allowed)

    def first_false(col: np.ndarray) -> int:
        bad = np.flatnonzero(~col)
        return int(bad[0]) if len(bad) else n

    cpu_ok = allowed[:, on_cpu].any(axis=1)
    bad_cpu = np.flatnonzero(~cpu_ok)
    prefix = {int(d): first_false(allowed[:, d]) for d in dpus}
    suffix = {}
    for g in gpus:
        bad = np.flatnonzero(~allowed[:, g])
        suffix[int(g)] = int(bad[-1]) + 1 if len(bad) else 0
    for i in range(n + 1):
        k = int(np.searchsorted(bad_cpu, i))
        stop = int(bad_cpu[k]) if k < len(bad_cpu) else n
        on_dpu = [d for d, end in prefix.items() if end >= i] if i else [None]
        for j in range(i, stop + 1):
            on_gpu = [g for g, start in suffix.items() if start <= j] if j < n else [None]
            for dpu in on_dpu:
                for gpu in on_gpu:
                    yield i, j, dpu, gpu


@dataclass(frozen=True)
class Shaped:
    """The placement to plan, its runner-up when that was found on the way, the notes that say
    what its shape costs, and, when it is the best of the shapes the runtime runs instead of
    the best overall, what is proven of it among those (`Runnable.gaps`; None otherwise)."""

    best: np.ndarray
    second: np.ndarray | None
    notes: tuple[str, ...]
    runnable_gaps: tuple[float, float] | None = None


def plan_shape(
    model: CostModel,
    goal: Goal,
    allowed: np.ndarray,
    best: np.ndarray,
    only_runnable: bool,
    limit: float,
) -> Shaped:
    """The placement to plan: `best`, or with `only_runnable` and `best` of a shape the runtime
    does not run, the best runnable one."""
    if runnable(model, best):
        return Shaped(best, None, ())
    shape = shape_text(stage_kinds(model, best))
    if not only_runnable:
        return Shaped(
            best,
            None,
            (
                f"this plan's stages ({shape}) are not a shape the runtime runs yet ([a DPU stage] "
                "-> host CPU stages -> [a GPU stage]); `--runnable` plans the best one it runs",
            ),
        )
    found = best_runnable(model, goal, allowed, limit)
    chosen, second = found.best, found.second
    partial = found.searched < found.shapes
    if chosen is None:
        if partial:
            raise PlanError(
                f"no runnable placement ([a DPU stage] -> host CPU stages -> [a GPU stage]) was "
                f"found in the time limit: {found.searched} of the {found.shapes} shapes this "
                f"DAG can take were searched (the best placement overall: {shape}); "
                "give more --time-limit, or plan without --runnable"
            )
        raise PlanError(
            f"the only feasible placements have stages like {shape}, which the runtime does not "
            "run yet ([a DPU stage] -> host CPU stages -> [a GPU stage])"
        )
    m = evaluate(model, np.array([best, chosen]))
    what = {
        "throughput": lambda k: f"{1e3 / float(m.bottleneck[k]):,.0f} items/s",
        "latency": lambda k: f"latency {float(m.latency[k]):.3f} ms",
        "host-cpu": lambda k: f"host CPU {float(m.host[k]):.4f} ms/item",
    }[goal.objective]
    notes = (
        f"the best placement overall ({shape}, {what(0)}) is not a shape the runtime runs yet "
        f"([a DPU stage] -> host CPU stages -> [a GPU stage]): this is the best one it runs "
        f"({shape_text(stage_kinds(model, chosen))}, {what(1)})",
    )
    if partial:
        notes += (
            f"the time limit let the runnable search solve {found.searched} of the "
            f"{found.shapes} shapes this DAG can take: this plan is the best of those, not "
            "proven the best runnable one",
        )
    return Shaped(chosen, second, notes, found.gaps)


def shape_text(kinds: Sequence[str]) -> str:
    """Stage kinds in order ("dpu -> cpu -> gpu"), counted when there are too many to read."""
    if len(kinds) <= 8:
        return " -> ".join(kinds)
    count = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return f"{len(kinds)} stages: " + ", ".join(f"{n} on {k}" for k, n in count.items())
