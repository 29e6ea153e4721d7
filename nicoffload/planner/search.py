"""A packing heuristic for parallel chains: local search over where each copy's nodes run.

HiGHS refutes a load cap below the optimum quickly, but takes seconds to find the tight
packings an optimum is made of (every device within a fraction of a percent of the
bottleneck). From a packing that is close, this moves one node of one copy at a time, each
time the move that most reduces the overload above a target, weighing more the resources that
stay over (breakout); it keeps the best placement it passes through. It proves nothing: what
it returns is a placement like any other, judged by the same caps, and a miss says nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nicoffload.planner.branches import Chains
from nicoffload.planner.evaluate import REL_TOL

MOVERS = 40  # copies whose moves are weighed per step, drawn from those on the worst resource
STALL = 50  # steps without a better placement before giving up


class _Class:
    """One class of chains: its transitions as a table and what each arc uses."""

    def __init__(self, model, ch: Chains, mem_dev: np.ndarray) -> None:
        D = len(model.devices)
        self.ch, self.D, self.k = ch, D, ch.length
        self.step = np.full((ch.n_states, D + 1), -1, np.intp)  # (state, device or D: sink)
        self.step[ch.tail, np.where(ch.dev >= 0, ch.dev, D)] = np.arange(len(ch.tail))
        host = np.zeros(len(model.resources), bool)
        host[:D] = model.host
        mem = (ch.dev[:, None] == mem_dev[None, :]) * ch.mem[:, None]
        # columns: every resource's load (T units), host work (H units), memory of capped devices
        self.cols = np.c_[ch.load / model.divisor, ch.load[:, host].sum(axis=1), mem]

    def arcs(self, devs: np.ndarray) -> np.ndarray:
        """(N, k) devices -> (N, k + 1) chain arcs; rows with a missing step start with -1."""
        N = len(devs)
        out = np.empty((N, self.k + 1), np.intp)
        state = np.zeros(N, np.intp)
        ok = np.ones(N, bool)
        for i in range(self.k + 1):
            a = self.step[state, devs[:, i] if i < self.k else self.D]
            ok &= a >= 0
            out[:, i] = a = np.where(ok, a, 0)
            state = self.ch.head[a]
        out[~ok, 0] = -1
        return out


@dataclass(frozen=True)
class Packing:
    """The best placement a search passed through."""

    paths: list[np.ndarray]  # per class, (copies, length + 1) chain arcs
    t: float  # its busiest resource, ms per item
    h: float  # its host CPU, ms per item


def pack(
    model,
    classes: list[Chains],
    start: list[np.ndarray],
    target: float,
    h_cap: float = np.inf,
    lat_cap: float = np.inf,
    steps: int = 400,
    seed: int = 0,
) -> Packing | None:
    """Lower the busiest resource's load towards `target`, host CPU within `h_cap`, every
    path's latency within `lat_cap` and memory within its limits. Starts from `start` (per
    class, (copies, length + 1) arcs); returns the least loaded placement within those caps
    that it passed through (the start included), or None when it met none. It takes at most
    `steps` steps (a count, not a time: the same start gives the same packing on any machine)."""
    rng = np.random.default_rng(seed)
    mem_dev = np.flatnonzero(np.isfinite(model.mem_cap))
    cls = [_Class(model, ch, mem_dev) for ch in classes]
    R = len(model.resources)
    slack = 1 + REL_TOL / 2  # as the flow problems allow (branches.bucketed)
    cap = np.r_[np.full(R, target * slack), h_cap * slack, model.mem_cap[mem_dev]]
    hard = np.r_[np.full(R, np.inf), h_cap * slack, model.mem_cap[mem_dev]]  # memory: exact
    norm = np.where(np.isfinite(cap), 1.0 / np.maximum(cap, 1e-12), 0.0)
    lat_norm = 1.0 / lat_cap if np.isfinite(lat_cap) and lat_cap > 0 else 0.0
    lat_cap *= slack
    devs = [c.ch.dev[s[:, :-1]].copy() for c, s in zip(cls, start, strict=True)]
    use = [c.cols[s].sum(axis=1) for c, s in zip(cls, start, strict=True)]
    lat = [c.ch.latency(s) for c, s in zip(cls, start, strict=True)]
    total = sum(u.sum(axis=0) for u in use)
    weight = np.ones(len(cap))
    lat_w = 1.0
    best: Packing | None = None
    since = 0
    for _ in range(steps):
        if since >= STALL:
            break
        since += 1
        within = np.all(total <= hard) and max(float(x.max()) for x in lat) <= lat_cap
        if within and (best is None or total[:R].max() < best.t):
            paths = [c.arcs(d) for c, d in zip(cls, devs, strict=True)]
            fresh = sum(c.cols[p].sum(axis=(0, 1)) for c, p in zip(cls, paths, strict=True))
            best = Packing(paths, float(fresh[:R].max()), float(fresh[R]))
            since = 0
        over = np.maximum(0.0, total - cap) * norm * weight
        late = [np.maximum(0.0, x - lat_cap) * lat_norm * lat_w for x in lat]
        excess = over.sum() + sum(x.sum() for x in late)
        if excess <= 0:
            break
        k = int(np.argmax(over)) if over.any() else -1
        move, score_best = None, np.inf
        for ci, (c, d) in enumerate(zip(cls, devs, strict=True)):
            late_or_on_k = late[ci] > 0  # as union1d of the two, without its sorting
            if k >= 0:
                late_or_on_k |= use[ci][:, k] > 0
            who = np.flatnonzero(late_or_on_k)
            if len(who) > MOVERS:
                who = rng.choice(who, MOVERS, replace=False)
            if not len(who):
                continue
            # every move of one node of those copies to another device
            n = c.k * c.D
            cand = np.repeat(d[who], n, axis=0)
            copy = np.repeat(who, n)
            pos = np.tile(np.repeat(np.arange(c.k), c.D), len(who))
            cand[np.arange(len(cand)), pos] = np.tile(np.arange(c.D), c.k * len(who))
            arcs = c.arcs(cand)
            ok = (arcs[:, 0] >= 0) & np.any(cand != d[copy], axis=1)
            if not ok.any():
                continue
            cand, copy, arcs = cand[ok], copy[ok], arcs[ok]
            u = c.cols[arcs].sum(axis=1)
            new_lat = c.ch.latency(arcs)
            score = (np.maximum(0.0, total - use[ci][copy] + u - cap) * norm * weight).sum(axis=1)
            score += excess - over.sum() - late[ci][copy]
            score += np.maximum(0.0, new_lat - lat_cap) * lat_norm * lat_w
            low = np.flatnonzero(score <= score.min())
            j = int(rng.choice(low))
            if score[j] < score_best:
                score_best, move = score[j], (ci, int(copy[j]), cand[j], u[j], new_lat[j])
        if move is None:
            break
        if score_best >= excess * (1 - 1e-12):  # a local minimum: weigh what stays over
            weight[over > 0] += 1.0
            lat_w += 1.0 if any(x.any() for x in late) else 0.0
            continue
        ci, j, row, u, new_lat = move
        total += u - use[ci][j]
        use[ci][j], lat[ci][j], devs[ci][j] = u, new_lat, row
    return best
