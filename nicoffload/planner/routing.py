"""Packings found without HiGHS where nothing is left to choose: counts routed by a walk, and
the host-CPU stage's packing without host CPU.

HiGHS finds a packing of the (class, position, device) counts with the arcs fractional; the
copies are then routed through the class's graph for those counts. Where every position of a
class has all its copies on one device (a class of one copy, as each camera of another
resolution is), the counts name one device per position, so one chain path
(`Chains.path_of`): routing it is a walk, not a MILP (0.05-0.07 s of HiGHS per packing on
the 50-node bench's 12 camera resolutions). The walk keeps to the problem's own graph (its
latency bound), and the packing is judged by the caps as any other; counts that leave a
choice, or a walk or a cap that fails, are left to the MILP. Host CPU is never below 0, so a
packing without any (`hostless`) is the host-CPU stage's optimum, with no bound to prove.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # flow imports this module
    from nicoffload.planner.flow import FlowProblem, Outcome


def route(problem: FlowProblem, counts: np.ndarray, t_cap: float, h_cap: float) -> Outcome | None:
    """The Outcome ("found") of `problem`'s solution with the count columns' values `counts`
    (all classes' count columns, in order), or None when they leave a choice or it breaks a
    cap (memory included)."""
    D = len(problem.model.devices)
    x = np.zeros(problem.nv)
    at = 0
    for c, ch in enumerate(problem.classes):
        n = counts[at : at + len(problem.counts[c])]
        at += len(problem.counts[c])
        full = np.flatnonzero(n == ch.copies)
        pos, dev = np.divmod(problem.keys[c][full], D)
        if not np.array_equal(np.sort(pos), np.arange(ch.length)):
            return None  # some position's copies are split between devices
        try:
            arcs = _walk(problem, c, ch.path_of(dev[np.argsort(pos)]))
        except StopIteration:  # no chain arc for that sequence of devices
            arcs = None
        if arcs is None:
            return None
        x[problem.offsets[c] + arcs] = ch.copies
    o = problem.outcome(x, None)
    if o.t > t_cap or o.h > h_cap or not fits(problem, o.paths):
        return None
    return o


def _walk(problem: FlowProblem, c: int, path: np.ndarray) -> np.ndarray | None:
    """The expanded arcs of chain path `path` in class c's graph, or None where it leaves
    the graph (a path over the latency bound)."""
    g = problem.graphs[c]
    step = problem.steps(c)
    out, state = [], 0
    for a in path:
        e = step.get((state, int(a)))
        if e is None:
            return None
        out.append(e)
        state = int(g.head[e])
    return np.array(out, np.intp) if state == g.sink else None


def fits(problem: FlowProblem, paths: list[np.ndarray]) -> bool:
    """Whether the copies on `paths` (per class, chain arcs) keep every device's memory."""
    model = problem.model
    mem = np.zeros(len(model.devices))
    for ch, rows in zip(problem.classes, paths, strict=True):
        dev = ch.dev[rows]
        np.add.at(mem, np.maximum(dev, 0), np.where(dev >= 0, ch.mem[rows], 0.0))
    return bool((mem <= model.mem_cap).all())


def hostless(problem: FlowProblem, t_cap: float) -> Outcome | None:
    """Every copy of each class on the path of least host work through its graph (the
    problem's: within its latency bound), as a packing, when that puts no host CPU anywhere
    and keeps the load cap and memory; else None (a packing may still exist: HiGHS decides).
    Host CPU is never below 0, so such a packing is the least (0.3 s of HiGHS on 12 camera
    branches of 12 resolutions, where it exists)."""
    if problem.empty:
        return None
    model = problem.model
    lc, lr, lv = problem.loads
    host = np.r_[model.host, np.zeros(len(model.resources) - len(model.host), bool)]
    work = np.zeros(problem.nv)  # host work of one copy on each column
    on = host[lr]
    np.add.at(work, lc[on], lv[on] * model.divisor[lr[on]])
    x = np.zeros(problem.nv)
    for c, (ch, g) in enumerate(zip(problem.classes, problem.graphs, strict=True)):
        arcs = _least_path(
            g, ch.tail[g.arc], work[problem.offsets[c] : problem.offsets[c] + len(g.arc)]
        )
        if arcs is None:
            return None
        x[problem.offsets[c] + arcs] = ch.copies
    o = problem.outcome(x, "H")
    if o.h > 1e-12 or o.t > t_cap or not fits(problem, o.paths):
        return None
    o.status, o.bound = "optimal", o.h
    return o


def _least_path(g, order_key: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
    """The expanded arcs of the least-weight source-to-sink path of `g` (the first in arc
    order among equals), or None when the sink is not reached. `order_key`: per arc, its
    chain tail state, which orders the arcs as the chain's states (heads after tails)."""
    if g.sink >= g.n_states:
        return None
    dist = [np.inf] * g.n_states
    into = [-1] * g.n_states
    dist[0] = 0.0
    tail, head, w = g.tail.tolist(), g.head.tolist(), weight.tolist()
    for e in np.argsort(order_key, kind="stable").tolist():
        d = dist[tail[e]] + w[e]
        if d < dist[head[e]]:
            dist[head[e]], into[head[e]] = d, e
    if into[g.sink] < 0:
        return None
    arcs, at = [], g.sink
    while at != 0:
        arcs.append(into[at])
        at = tail[into[at]]
    return np.array(arcs[::-1], np.intp)
