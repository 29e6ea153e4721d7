"""How firm a plan's choice is: by what factor one thing about the machine must change for the
runner-up to beat the plan on its objective, everything else held (`plan --explain`).

The things: the speed of each kind of device (every device of that kind, its kernels, its end
of every transfer, what other nodes load it with; for the host CPU, the host process's serial
time too) and the links' bandwidth. A factor above 1
is faster, below 1 slower; none where no factor from 1/16 to 16 turns the order. It compares
the two placements only: another placement might overtake the plan sooner. Pure functions of
the cost model (`evaluate` on a rescaled copy), no search; where the objective is a load and
no SLO is set, two evaluations give the objective at every factor (`_lines`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import OBJECTIVE, REL_TOL, Goal, evaluate

LIMIT = 16.0  # the factors tried: 1/LIMIT .. LIMIT
GRID = 24  # grid steps per direction, 1 -> LIMIT: each about 12% (a narrower window is missed)
STEPS = 16  # bisection steps within one grid step: log(factor) to about 2e-6


def scaled(model: CostModel, what: str, factor: float) -> CostModel:
    """`model` with `what` ("link" or a device kind) `factor` times as fast."""
    D = len(model.devices)
    if what == "link":
        load = model.route_load.copy()
        load[:, :, D:] /= factor
        return dataclasses.replace(
            model, route_load=load, route_ms_per_byte=model.route_ms_per_byte / factor
        )
    on = np.array([k == what for k in model.kinds]) if model.kinds else np.zeros(D, bool)
    cols = np.flatnonzero(on)
    cost = model.cost.copy()
    cost[:, cols] /= factor
    groups = tuple(
        dataclasses.replace(g, delta=np.where(on, g.delta / factor, g.delta)) for g in model.groups
    )
    load, fixed = model.route_load.copy(), model.route_fixed.copy()
    load[:, :, cols] /= factor  # its end of each transfer (CPU time per byte and per batch)
    fixed[:, :, cols] /= factor
    side = tuple((v, d, k, ms / factor if k < D and on[k] else ms) for v, d, k, ms in model.side)
    changes: dict[str, Any] = {
        "cost": cost,
        "groups": groups,
        "route_load": load,
        "route_fixed": fixed,
        "side": side,
    }
    if model.serial is not None and what == "cpu":
        # the host process's Python, on every column (a GPU stage's too: its host side), is
        # the host CPU's; a faster GPU or DPU does not shorten it
        changes["serial"] = model.serial / factor
    if model.base is not None:
        base = model.base.copy()
        base[cols] /= factor
        changes["base"] = base
    return dataclasses.replace(model, **changes)


def _wins(model: CostModel, goal: Goal, best: np.ndarray, second: np.ndarray) -> bool:
    """Whether `second` is feasible and better than `best` on the primary objective."""
    m = evaluate(model, np.stack([best, second]))
    primary = m.keys(goal.objective)[0]
    feasible = m.feasible(goal)
    if not feasible[1]:
        return False
    return bool(not feasible[0] or primary[1] < primary[0] * (1 - REL_TOL) - 1e-12)


def _lines(
    model: CostModel, goal: Goal, best: np.ndarray, second: np.ndarray, what: str
) -> Callable[[float], bool] | None:
    """_wins at the factor exp(g), from two evaluations instead of one per factor: where the
    objective is the busiest resource or the host CPU and the goal caps neither latency nor
    load, each resource's load, the host process's serial time and the host CPU are a + b / f
    in the factor f (`scaled` divides by f, and `evaluate` sums), and feasibility does not
    depend on f; None elsewhere (a latency is a longest path: no line)."""
    primary = OBJECTIVE[goal.objective].primary
    if primary == "latency" or np.isfinite(goal.max_load_ms) or np.isfinite(goal.latency_cap):
        return None
    P = np.stack([best, second])
    at1, at2 = evaluate(model, P), evaluate(scaled(model, what, 2.0), P)

    def columns(m) -> np.ndarray:  # the primary is the largest of these, per placement
        return np.c_[m.load, m.serial] if primary == "bottleneck" else m.host[:, None]

    b = 2.0 * (columns(at1) - columns(at2))
    a = columns(at1) - b
    ok = at1.ok

    def wins(g: float) -> bool:
        if not ok[1]:
            return False
        p = (a + b * math.exp(-g)).max(axis=1)
        return bool(not ok[0] or p[1] < p[0] * (1 - REL_TOL) - 1e-12)

    return wins


def crossing(
    model: CostModel, goal: Goal, best: np.ndarray, second: np.ndarray, what: str
) -> float | None:
    """The factor nearest 1 (in log terms) at which `second` starts to beat `best` when
    `what` changes alone; None where it does not within 1/LIMIT .. LIMIT. Each direction is
    scanned on a grid (the runner-up may win only inside the range: its advantage need not
    grow one way), then the first winning step is bisected."""
    wins = _lines(model, goal, best, second, what) or (
        lambda g: _wins(scaled(model, what, math.exp(g)), goal, best, second)
    )
    return scan(wins)


def scan(wins: Callable[[float], bool]) -> float | None:
    """crossing's search, of `wins` (at the factor exp(g))."""
    found = []
    step = math.log(LIMIT) / GRID
    for sign in (1.0, -1.0):
        grid = (sign * step * (i + 1) for i in range(GRID))
        hi = next((g for g in grid if wins(g)), None)
        if hi is None:
            continue
        lo = hi - sign * step  # the step before: the plan still wins there (at 1 by definition)
        for _ in range(STEPS):
            mid = (lo + hi) / 2
            if wins(mid):
                hi = mid
            else:
                lo = mid
        found.append(math.exp(hi))
    return min(found, key=lambda f: abs(math.log(f)), default=None)


def sensitivity(
    model: CostModel, goal: Goal, best: np.ndarray, second: np.ndarray | None
) -> list[dict[str, Any]]:
    """Per thing that can change (the links, each kind of device the model has), the factor at
    which the runner-up would win, with a sentence; [] without a runner-up."""
    if second is None:
        return []
    kinds = sorted(set(model.kinds)) if model.kinds else []
    names = {"cpu": "the host CPU", "dpu": "the DPUs", "gpu": "the GPUs", "link": "the links"}
    out = []
    for what in ("link", *kinds):
        f = crossing(model, goal, best, second, what)
        name = names.get(what, f"the {what} devices")
        speed = "bandwidth" if what == "link" else "speed"
        if f is None:
            text = f"{name}: no {speed} from 1/{LIMIT:g} to {LIMIT:g}x makes the runner-up win"
        else:
            change = f"{f:.3g}x" if f >= 2 else f"1/{1 / f:.3g}" if f <= 0.5 else f"{f - 1:+.0%}"
            text = f"{name} at {change} {speed}"
        out.append({"what": what, "factor": None if f is None else float(f"{f:.4g}"), "text": text})
    return out
