"""Exact dynamic programming over a chain of nodes (decode -> resize -> crop -> normalize).

A state is the device of the last placed node (and the first node of its run there whose
fusion is not yet decided) with the vector of everything the objective and the constraints can
still grow: each resource's work, the item's time so far, the latency of outputs already
delivered, and memory.
The future adds the same to every state of one key, so a state dominated componentwise by
another of its key is never better: pruning those (and states whose lower bound already exceeds
an incumbent) keeps the search exact. Brute force in the tests checks that.

Which nodes run fused depends on where their run ends (`fusion`), so a run's fused deltas are
added when that is known: at a cut (no window crosses it; outputs are cuts) or when the next
node goes elsewhere. Until then a state counts the nodes' own costs (bounds allow for it).
"""

from __future__ import annotations

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import REL_TOL, Goal, best_row, evaluate
from nicoffload.planner.fusion import group_cuts, settle_table


def is_chain(model: CostModel) -> bool:
    """Every tensor flows only to the next node; pipeline inputs only to the first."""
    return all(set(r.consumers) <= ({0} if r.src < 0 else {r.src + 1}) for r in model.refs)


def _pareto(vecs: np.ndarray) -> np.ndarray:
    """Indices of the rows no other row dominates (<= everywhere); one of equal rows is kept."""
    order = np.argsort(vecs.sum(axis=1), kind="stable")
    kept: list[int] = []
    block = np.empty_like(vecs)  # the kept rows, in place (a copy per row was quadratic)
    for i in order:
        if kept and (block[: len(kept)] <= vecs[i] + 1e-12).all(axis=1).any():
            continue
        block[len(kept)] = vecs[i]
        kept.append(i)
    return np.array(kept, dtype=np.intp)


def _relief(model: CostModel, v: int, cut: np.ndarray) -> np.ndarray:
    """The most that fused groups not yet added after node v (those ending at or after the
    last cut before it) can still take off each component (bounds subtract it)."""
    R, D = len(model.resources), len(model.devices)
    out = np.zeros(R + 2 + D)
    since = int(np.flatnonzero(cut[: v + 1])[-1])
    for g in model.groups:
        if g.nodes[-1] >= since:
            gain = np.maximum(0.0, -np.nan_to_num(g.delta, nan=0.0))
            out[:D] += gain
            out[R] += gain.max()
    return out


def _bounds(model: CostModel, vecs: np.ndarray, relief: np.ndarray) -> tuple[np.ndarray, ...]:
    """Lower bounds of the final (bottleneck, latency, host) of each state."""
    R, D = len(model.resources), len(model.devices)
    low = vecs - relief
    bottleneck = (low[:, :R] / model.divisor).max(axis=1)
    latency = np.maximum(low[:, R], vecs[:, R + 1])
    host = low[:, :D][:, model.host].sum(axis=1)
    return bottleneck, latency, host


def _incumbent(model: CostModel, goal: Goal, allowed: np.ndarray) -> float:
    """The primary value of the best simple placement (all on one device, or each node's
    cheapest device); any state whose bound exceeds it cannot be optimal."""
    tries = [np.argmin(np.where(allowed, model.cost, np.inf), axis=1)]
    tries += [np.full(model.n, d) for d in range(len(model.devices)) if allowed[:, d].all()]
    P = np.array(tries, dtype=np.intp)
    m = evaluate(model, P)
    ok = m.feasible(goal) & allowed[np.arange(model.n), P].all(axis=1)
    m = evaluate(model, P[ok]) if ok.any() else None
    i = best_row(m, goal) if m is not None else None
    return np.inf if i is None else float(m.keys(goal.objective)[0][i])


def solve_chain(
    model: CostModel, goal: Goal, allowed: np.ndarray | None = None
) -> np.ndarray | None:
    """The best placement of a chain (device index per node), or None when nothing is feasible."""
    allowed = model.allowed if allowed is None else allowed & model.allowed
    D, R, n = len(model.devices), len(model.resources), model.n
    K = R + 2 + D  # work per resource, time so far, latency of outputs so far, memory per device
    T, LAT = R, R + 1
    cap = _incumbent(model, goal, allowed) * (1 + REL_TOL) + 1e-12
    fused, cut = settle_table(model), group_cuts(model)
    out_of = {u: [r for r in model.refs if r.src == u] for u in range(n)}
    inputs = [r for r in model.refs if r.src < 0]
    # frontier: (device, first node of its run not yet settled) -> (vectors (F, K), placements)
    frontier: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for d in np.flatnonzero(allowed[0]):
        vec = np.zeros(K)
        for r in inputs:
            if model.ingress != d:
                vec[:R] += model.ref_load(r)[model.ingress, d]
                vec[T] = max(vec[T], model.ref_time(r, model.ingress, d))
        vecs = vec[None, :]
        key = (d, _place(model, vecs, 0, d, 0, fused, cut))
        frontier[key] = (vecs, np.array([[d]], dtype=np.int8))
    frontier = _prune(model, goal, frontier, cap, _relief(model, 0, cut))
    for v in range(1, n + 1):
        grown: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
        targets = np.flatnonzero(allowed[v]) if v < n else [None]
        for (d, p), (vecs, placed) in frontier.items():
            for t in targets:
                new = vecs.copy()
                if t != d and p < v:  # the run ends at v - 1: its fusion is known now
                    _settle(new, R, fused[p, v - 1, d], d)
                for r in out_of[v - 1]:
                    dests = set()
                    if t is not None and v in r.consumers:
                        dests.add(t)
                    if r.output:
                        dests.add(model.egress)
                        deliver = new[:, T] + model.ref_time(r, d, model.egress)
                        new[:, LAT] = np.maximum(new[:, LAT], deliver)
                    for dest in dests - {d}:
                        new[:, :R] += model.ref_load(r)[d, dest]
                if t is None:
                    grown.setdefault((d, v), []).append((new, placed))
                    continue
                arrive = max(
                    (model.ref_time(r, d, t) for r in out_of[v - 1] if v in r.consumers),
                    default=0.0,
                )
                new[:, T] += arrive
                key = (t, _place(model, new, v, t, p if t == d else v, fused, cut))
                column = np.full((len(placed), 1), t, dtype=np.int8)
                grown.setdefault(key, []).append((new, np.hstack([placed, column])))
        frontier = {
            k: (np.vstack([a for a, _ in parts]), np.vstack([b for _, b in parts]))
            for k, parts in grown.items()
        }
        frontier = _prune(model, goal, frontier, cap, _relief(model, v, cut))
    if not frontier:
        return None
    P = np.vstack([placed for _, placed in frontier.values()]).astype(np.intp)
    i = best_row(evaluate(model, P), goal)
    return None if i is None else P[i]


def _settle(vecs: np.ndarray, R: int, delta: float, d: int) -> None:
    vecs[:, d] += delta
    vecs[:, R] += delta


def _place(
    model: CostModel, vecs: np.ndarray, v: int, d: int, p: int, fused: np.ndarray, cut: np.ndarray
) -> int:
    """Add node v on device d to state vectors, in place, its run's unsettled part starting at
    node p; at a cut after v that part's fused deltas are added. Returns the new p."""
    R = len(model.resources)
    ms = model.cost[v, d]
    vecs[:, d] += ms
    vecs[:, R] += ms
    for sv, sd, k, extra in model.side:  # `planner.side`: load on another resource
        if sv == v and sd == d:
            vecs[:, k] += extra
    vecs[:, R + 2 + d] += model.mem[v]
    if cut[v + 1]:
        _settle(vecs, R, fused[p, v, d], d)
        return v + 1
    return p


def _prune(model: CostModel, goal: Goal, frontier: dict, cap: float, relief: np.ndarray) -> dict:
    R, D = len(model.resources), len(model.devices)
    slack = 1 + REL_TOL
    out = {}
    for key, (vecs, placed) in frontier.items():
        bottleneck, latency, host = _bounds(model, vecs, relief)
        primary = {"throughput": bottleneck, "latency": latency, "host-cpu": host}[goal.objective]
        keep = (
            (bottleneck <= goal.max_load_ms * slack)
            & (latency <= goal.latency_cap * slack)
            & np.all(vecs[:, R + 2 : R + 2 + D] <= model.mem_cap, axis=1)
            & (primary <= cap)
        )
        vecs, placed = vecs[keep], placed[keep]
        if len(vecs):
            idx = _pareto(vecs)
            out[key] = (vecs[idx], placed[idx])
    return out
