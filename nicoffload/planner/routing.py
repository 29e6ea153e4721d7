"""Counts routed without HiGHS, where they leave no choice (flow.FlowProblem.find).

HiGHS finds a packing of the (class, position, device) counts with the arcs fractional; the
copies are then routed through the class's graph for those counts. Where every position of a
class has all its copies on one device (a class of one copy, as each camera of another
resolution is), the counts name one device per position, so one chain path
(`Chains.path_of`): routing it is a walk, not a MILP (0.05-0.07 s of HiGHS per packing on
the 50-node bench's 12 camera resolutions). The walk keeps to the problem's own graph (its
latency bound), and the packing is judged by the caps as any other; counts that leave a
choice, or a walk or a cap that fails, are left to the MILP.
"""

from __future__ import annotations

import numpy as np


def route(problem, counts: np.ndarray, t_cap: float, h_cap: float):
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


def _walk(problem, c: int, path) -> np.ndarray | None:
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


def fits(problem, paths: list[np.ndarray]) -> bool:
    """Whether the copies on `paths` (per class, chain arcs) keep every device's memory."""
    model = problem.model
    mem = np.zeros(len(model.devices))
    for ch, rows in zip(problem.classes, paths, strict=True):
        dev = ch.dev[rows]
        np.add.at(mem, np.maximum(dev, 0), np.where(dev >= 0, ch.mem[rows], 0.0))
    return bool((mem <= model.mem_cap).all())
