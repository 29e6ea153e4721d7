"""Lexicographic planning of a DAG of parallel chains (branches.py) with the flow MILP (flow.py).

For a min-max load HiGHS refutes a cap below the optimum in milliseconds (a resource's capacity
bounds its integer counts: three decodes fit on this DPU, not four), while the search for a
packing that meets the optimum takes far longer, and longer still when it must also prove it.
So a load stage raises a proven lower bound with short tries (a bounded number of HiGHS
nodes: a count, never a time, so that a loaded machine plans the same), searches for a
packing just above it, and proves what it found by refuting just below (as the least load
under that cap, which HiGHS proves sooner than a bare feasibility question). Where no quick
try refutes even a cap just above the bound, it asks at once for the least load below the
best packing found, instead of proving cap after cap. A latency stage does the same over
the latencies paths can have, each probe a flow problem bucketed at that bound, from the LP's
bound of the least latency (latency_flow.py: on 12 camera branches of 12 resolutions the
optimum itself, so one probe finds it and nothing under it needs refuting). Tries and
searches solve the counts first with the arcs fractional (FlowProblem.find). Each packing a
load stage finds is polished by a local search (search.py) towards the proven bound, so one
search just above the optimum is enough. Every answer is proven optimal (within REL_TOL) or
comes back with the gap that is left.

HiGHS's MIP presolve can call a feasible problem infeasible (ERGO-Code/HiGHS#2388), so its
refutations and bounds only steer the search: a stage stops on a bound only once the
refutation it rests on (a cap just below the packing found) is re-checked without presolve
(_Search.confirm). A packing the re-check finds is a better one, and the search goes on from
the bounds already re-checked; a re-check that does not finish leaves the gap those prove.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from nicoffload.planner.branches import Bucketed, Chains, bucket_key, bucketed, suffixes
from nicoffload.planner.evaluate import OBJECTIVE, REL_TOL, Goal
from nicoffload.planner.flow import FlowProblem, Outcome, placement, row_scale
from nicoffload.planner.latency_flow import latency_bound
from nicoffload.planner.routing import hostless
from nicoffload.planner.search import pack

BELOW = 1 - 2 * REL_TOL  # a cap this far under a value asks "is anything better?"
NARROW = 1e-3  # quick refutations narrow a load bound to this before a long search
HEAVY = 1 / 8  # a node taking this much of the load cap anywhere it runs is heavy (_heavy)
SKEW = 4  # bisect nearer the proven side: a refutation costs a fraction of a failed try
CLOSE = 1e-2  # a packing this close to the bound is proven or bettered by one long search
# Work limits, never time: the search takes the same steps on an idle and on a loaded machine,
# so the same inputs give the same plan; only the caller's deadline (--time-limit) may cut it,
# and the result then says so (Result.cut).
REFUTE_NODES = 100  # a quick try's HiGHS branch-and-bound nodes
CONFIRM_NODES = 400  # an early re-check's (a deadline in the long search then leaves its gap)
DIRECT_NODES = 200  # HiGHS alone first: small problems are solved outright within these
DIRECT_ARCS = 400  # and only on problems of at most this many flow columns: HiGHS's root
# node alone, which a node limit does not bound, took 0.4-7 s on the 50- and 200-node benches
NEAR_NODES = 2000  # a search near a start (_Search.near)
POLISH_STEPS = 400  # the most moves one local search (search.py) may make


@dataclass
class Result:
    placement: np.ndarray | None
    status: str
    gap: float  # relative gap left on the primary objective (0 when proven)
    solves: int
    tie_gap: float = 0.0  # the same for the secondary (tie-break) objective
    cut: bool = False  # the deadline was reached: the search did not run to its end


@dataclass
class _Stage:
    best: Outcome | None
    value: float  # of best: its T, H or latency
    gap: float  # 0: proven optimal; inf: nothing found
    infeasible: bool = False


@dataclass
class _Search:
    """The classes, the flow problems built so far (one per latency bound), and the deadline:
    every other limit is a count of work (module constants), so that only the deadline makes
    the search depend on the clock."""

    model: object
    classes: list[Chains]
    deadline: float
    differ: list[np.ndarray] | None = None
    solves: int = 0
    _suffixes: list | None = None
    _problems: dict = field(default_factory=dict)
    _bucketed: dict = field(default_factory=dict)
    _scale: float | None = None

    def left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    @property
    def cut(self) -> bool:
        """Whether the deadline has passed: HiGHS runs to at least its limit, so a call the
        deadline stopped ends after it."""
        return time.perf_counter() >= self.deadline

    def suffixes(self) -> list:
        if self._suffixes is None:
            self._suffixes = [suffixes(ch) for ch in self.classes]
            if any(x is None for x in self._suffixes):
                raise _TooBig
        return self._suffixes

    def problem(self, bound: float) -> FlowProblem:
        if bound not in self._problems:
            suff = self.suffixes() if np.isfinite(bound) else [None] * len(self.classes)
            if self._scale is None:
                self._scale = row_scale(self.model, self.classes)
            self._problems[bound] = FlowProblem(
                self.model,
                self.classes,
                suff,
                bound,
                self.differ,
                self._graphs(suff, bound),
                self._scale,
            )
        return self._problems[bound]

    def _graphs(self, suff: list, bound: float) -> list[Bucketed]:
        """The classes bucketed for `bound`: a latency search's probes differ in a few
        classes' graphs each (bisecting the latencies of all of them), so each class's
        graphs are kept by what they depend on (branches.bucket_key)."""
        out = []
        for c, (ch, sfx) in enumerate(zip(self.classes, suff, strict=True)):
            key = (c, bucket_key(ch, sfx, bound))
            if key not in self._bucketed:
                self._bucketed[key] = bucketed(ch, sfx, bound)
            out.append(self._bucketed[key])
        return out

    def solve(
        self, bound: float, objective, t_cap=np.inf, h_cap=np.inf, relax=False, nodes=None
    ) -> Outcome:
        """A search to the deadline (or `nodes` HiGHS nodes)."""
        self.solves += 1
        problem = self.problem(bound)
        return problem.solve(objective, t_cap, h_cap, self.left(), relax, nodes)

    def find(self, bound: float, t_cap=np.inf, h_cap=np.inf, objective=None) -> Outcome:
        """Any solution under the caps, or the least `objective` (to the deadline)."""
        self.solves += 1
        return self.problem(bound).find(t_cap, h_cap, self.left(), objective)

    def near(self, bound: float, start: Outcome | None, t_cap: float, h_cap: float):
        """A packing under the caps that keeps the heavy positions' counts of `start` (see
        FlowProblem.near), within NEAR_NODES; None when there is no start or no heavy
        position, or none is found."""
        if start is None or start.paths is None or self.differ is not None:
            return None
        heavy = [_heavy(self.model, ch, t_cap) for ch in self.classes]
        if not any(h.any() for h in heavy):
            return None
        self.solves += 1
        o = self.problem(bound).near(start.paths, heavy, t_cap, h_cap, self.left(), NEAR_NODES)
        return o if o.paths is not None else None

    def refute(self, bound: float, t_cap=np.inf, h_cap=np.inf, objective=None) -> Outcome:
        """A short try (REFUTE_NODES): "infeasible" is a proof, a packing a solution (with an
        `objective`, the least one found within the nodes); "unknown" says nothing."""
        self.solves += 1
        problem = self.problem(bound)
        return problem.find(t_cap, h_cap, self.left(), objective, nodes=REFUTE_NODES)

    def confirm(
        self, bound: float, t_cap=np.inf, h_cap=np.inf, objective=None, nodes=None
    ) -> Outcome:
        """A refutation re-checked without presolve, to the deadline (or `nodes` HiGHS nodes):
        "infeasible" is then a proof, a packing one that presolve hid; anything else (a limit)
        proves nothing.
        With an `objective`, a quick feasibility try first: without presolve it is sometimes
        far quicker (throughput's proof: 0.06 s against 0.3-1.6), sometimes slower (2-4 s
        against 2 for host-cpu's)."""
        problem = self.problem(bound)
        if objective is not None:
            self.solves += 1
            o = problem.find(t_cap, h_cap, self.left(), presolve=False, nodes=REFUTE_NODES)
            if o.status == "infeasible" or o.paths is not None:
                return o
        self.solves += 1
        return problem.find(t_cap, h_cap, self.left(), objective, presolve=False, nodes=nodes)

    def polish(self, o: Outcome | None, target: float, h_cap: float, bound: float):
        """`o`, or a less loaded packing within the same caps that the local search finds
        from it. For a runner-up, only one that still leaves `differ` somewhere (the search
        cannot see it: without a polish a runner-up's search crept down 1% per quick try)."""
        if o is None or o.paths is None or self.left() <= 0:
            return o
        got = pack(self.model, self.classes, o.paths, target, h_cap, bound, steps=POLISH_STEPS)
        if got is None or got.t >= o.t:
            return o
        if self.differ is not None and all(
            (p == path[None, :]).all() for p, path in zip(got.paths, self.differ, strict=True)
        ):
            return o
        return Outcome("found", got.paths, 0.0, -np.inf, got.t, got.h)

    def latency_bound(self, t_cap: float, h_cap: float) -> float:
        """A proven lower bound of the least latency under the caps (latency_flow's LP)."""
        self.solves += 1
        return latency_bound(self.problem(np.inf), t_cap, h_cap, self.left())

    def latency(self, paths: list[np.ndarray]) -> float:
        return max(float(ch.latency(p).max()) for ch, p in zip(self.classes, paths, strict=True))


class _TooBig(Exception):
    """A class has more distinct completion latencies than MAX_SUFFIXES."""


def _gap(value: float, bound: float) -> float:
    if value <= bound * (1 + 4 * REL_TOL) + 1e-12:
        return 0.0
    return float((value - bound) / value) if value > 0 else 0.0


def _min_h(s: _Search, bound: float, t_cap: float) -> _Stage:
    """Least host CPU: a linear objective, which HiGHS proves directly. No host CPU at all is
    the least there is: a packing without any, when one is at hand (routing.hostless), is the
    optimum without HiGHS. The LP's bound is proven (no integer presolve), so a quick try
    that finds a packing at it is the optimum, without the search (0.6 s on 12 camera
    branches of 12 resolutions, where that is 0)."""
    zero = hostless(s.problem(bound), t_cap) if s.differ is None else None
    if zero is not None:
        return _Stage(zero, zero.h, 0.0)
    lp = s.solve(bound, "H", t_cap=t_cap, relax=True)
    if lp.status == "relaxed":
        o = s.refute(bound, t_cap, max(0.0, lp.bound) * (1 + REL_TOL) + 1e-12)
        if o.paths is not None and _gap(o.h, max(0.0, lp.bound)) == 0:
            return _Stage(o, o.h, 0.0)
    o = s.solve(bound, "H", t_cap=t_cap)
    if o.status == "infeasible":
        o = s.confirm(bound, t_cap, np.inf, "H")
    if o.paths is None:
        return _Stage(
            None, np.inf, 0.0 if o.status == "infeasible" else np.inf, o.status == "infeasible"
        )
    return _Stage(o, o.h, 0.0 if o.status == "optimal" else _gap(o.h, max(0.0, o.bound)))


def _min_t(s: _Search, bound: float, t_cap: float, h_cap: float) -> _Stage:
    """Least busiest-resource load (see the module docstring)."""
    if s.problem(bound).n_flow <= DIRECT_ARCS:  # small problems end here
        o = s.solve(bound, "T", t_cap, h_cap, nodes=DIRECT_NODES)
    else:
        o = Outcome("unknown", None, np.inf, -np.inf)
    if o.status == "infeasible":
        o = s.confirm(bound, t_cap, h_cap, "T")
    if o.status == "infeasible":
        return _Stage(None, np.inf, 0.0, True)
    if o.status == "optimal":
        return _Stage(o, o.t, 0.0)
    best = o if o.paths is not None else None
    # lo steers the search (a cap at lo or under is infeasible, if presolve is right); sure is
    # what has been proven: the LP's bound (no integer presolve) or a re-checked refutation,
    # which a stage cut short by the deadline reports its gap against
    lp = s.solve(bound, "T", t_cap, h_cap, relax=True)
    if lp.status == "infeasible":
        return _Stage(None, np.inf, 0.0, True)
    sure = lp.bound if lp.status == "relaxed" else 0.0
    lo = max(o.bound, sure) if np.isfinite(o.bound) else sure

    def better(o: Outcome | None) -> Outcome | None:  # polished towards the proven bound
        return s.polish(o, lo * (1 + 4 * REL_TOL), h_cap, bound)

    best = better(best)
    hard: list[float] = []  # caps a quick try could not refute: higher ones are no easier
    refuted = False  # whether a quick try has refuted a cap here
    crept = False  # a long search refuted a cap no quick try could: ask for the least at once
    recheck = True  # whether the early re-check below is worth its time here
    while s.left() > 0:
        top = min(t_cap, best.t * BELOW) if best is not None else t_cap
        if best is not None and (top <= lo or best.t <= lo * (1 + 4 * REL_TOL) + 1e-12):
            claim = min(lo, top)  # nothing is at or under it: then best is optimal
            if claim > sure:
                o = s.confirm(bound, claim, h_cap, "T")
                if o.paths is not None and o.t >= best.t * (1 - REL_TOL):
                    # best's load let through by HiGHS's feasibility tolerance: a little lower
                    claim = min(claim, best.t * (1 - 3 * REL_TOL))
                    o = s.confirm(bound, claim, h_cap, "T")
                if o.paths is not None and o.t < best.t * (1 - REL_TOL):  # presolve hid it:
                    # lo may be false; o's bound (without presolve) is not
                    sure = lo = max(sure, min(o.bound, claim))
                    best = better(o)
                    continue
                if o.status != "infeasible":
                    break
                sure = claim
            return _Stage(best, best.t, _gap(best.t, sure))
        if top <= lo:
            break
        hi = min([top, *(h for h in hard if h > lo)])
        least = crept and best is not None
        if least:
            # the optimum may be far above the caps quick tries stalled at: proving them one
            # NARROW step at a time took dozens of long searches (2.4% of climb on a 12-branch
            # instance); the least load under `top` is one search that finds and proves it
            hi = top
        elif best is not None and hi == top and top not in hard:  # is anything better?
            hi = _probe_t(s, bound, top, h_cap, hard)
        step = 0.005
        while not least and isinstance(hi, float) and hi > lo * (1 + NARROW) and s.left() > 0:
            if best is not None and not refuted and top <= lo * (1 + CLOSE):
                hi = top  # a packing this close to the bound: one search settles it
                break
            if np.isfinite(hi):
                cap = (lo + hi) / 2 if refuted else lo * (1 + NARROW / 2)
            else:
                cap = lo * (1 + step)
            got = _probe_t(s, bound, cap, h_cap, hard)
            if got is None:
                lo, step, refuted = cap, step * 2, True
            elif isinstance(got, Outcome):
                hi = got
            elif not refuted and best is not None:  # no quick proof near the bound either
                hi = top
                break
            else:
                hi = cap
        if isinstance(hi, Outcome):  # found a better packing
            best = better(hi)
            continue
        if hi is None:
            lo = top
            continue
        if recheck and refuted and lo > sure:  # re-check the bound the long search starts
            # from, briefly: a deadline in that search then leaves the gap to it, not the LP's
            o = s.confirm(bound, lo, h_cap, nodes=CONFIRM_NODES)
            if o.paths is not None:  # presolve hid it: lo may be false, sure is not
                lo = sure
                best = better(o)
                continue
            if o.status == "infeasible":
                sure = lo
            else:  # too slow here to repeat at every step
                recheck = False
        # however long it takes: a packing up to hi; for "anything better?", the best one,
        # which HiGHS proves sooner with the objective to bound by than as a feasibility
        o = s.find(bound, hi, h_cap, "T" if hi == top and best is not None else None)
        if o.status == "infeasible":
            lo, crept = hi, True
            continue
        lo = max(lo, min(o.bound, hi))  # nothing under the cap is below its bound
        if o.paths is None:
            break
        best = better(o)
    if best is None:
        return _Stage(None, np.inf, np.inf)
    return _Stage(best, best.t, _gap(best.t, sure))


def _heavy(model, ch: Chains, t_cap: float) -> np.ndarray:
    """Per position of the chain, whether its node takes at least HEAVY of the cap on any
    device it can run on: few fit on a device, so an optimum leaves little choice there."""
    own = (
        ch.load[np.arange(len(ch.dev)), np.maximum(ch.dev, 0)]
        / model.divisor[np.maximum(ch.dev, 0)]
    )
    least = np.full(ch.length + 1, np.inf)
    np.minimum.at(least, ch.pos, np.where(ch.dev >= 0, own, np.inf))
    return least[: ch.length] >= HEAVY * t_cap


def _probe_t(s: _Search, bound: float, cap: float, h_cap: float, hard: list[float]):
    """None: refuted; an Outcome: a packing under the cap; the cap: not refuted in time."""
    o = s.refute(bound, cap, h_cap)
    if o.status == "infeasible":
        return None
    if o.paths is not None:
        return o
    hard.append(cap)
    return cap


def _min_latency(
    s: _Search, t_cap: float, h_cap: float, cap: float, start: Outcome | None
) -> _Stage:
    """Least latency: the answer is one of the latencies a path can have, at least the least
    every class needs and the LP's bound under the caps (latency_flow); bisect them with quick
    refutations, search the lowest not refuted."""
    cands = np.unique(np.concatenate([np.maximum(0.0, x[0]) for x in s.suffixes()]))
    floor = max(float(np.maximum(0.0, x[0][0])) for x in s.suffixes())
    cands = cands[(cands >= floor) & (cands <= cap * (1 + REL_TOL))]
    best, best_l = None, np.inf

    def index(lat: float) -> int:  # the candidate a found latency is
        return int(np.searchsorted(cands, lat * (1 + REL_TOL), side="right")) - 1

    if start is not None and start.paths is not None:
        best, best_l = start, s.latency(start.paths)
    lo = 0  # candidates under lo are refuted (if presolve is right)
    sure = 0  # candidates under sure are refuted by a re-checked refutation (or the LP)
    # without a cap every class takes its fastest path: the LP's bound is then the floor
    capped = np.isfinite([t_cap, h_cap, *s.model.mem_cap]).any()
    bound = s.latency_bound(t_cap, h_cap) if len(cands) and capped else -np.inf
    if np.isfinite(bound):  # the LP's bound is a proof: nothing under it needs refuting
        lo = sure = int(np.searchsorted(cands, bound * (1 - REL_TOL) - 1e-12, side="left"))
    hard: set[int] = set()  # candidates a quick try could not refute
    mid = lo  # the least not refuted is tried first: without a load cap it is the answer
    crept = False  # a long search refuted a candidate no quick try could: bisect with them
    recheck = True  # whether the early re-check below is worth its time here
    while s.left() > 0:
        top = index(best_l) - 1 if best is not None else len(cands) - 1  # would improve on best
        if lo > top:
            if top >= sure:  # refuting the best a better answer could have is the proof
                o = s.confirm(float(cands[top]), t_cap, h_cap)
                if o.paths is not None:  # presolve hid it: lo may be false, sure is not
                    best, best_l, lo, mid = o, s.latency(o.paths), sure, sure
                    continue
                if o.status == "infeasible":
                    sure = top + 1
            break
        hi = min([top, *(h for h in hard if h >= lo)])
        if crept:  # one candidate per long search was dozens of them (2-3 s each) on a
            # 12-branch instance: halve the candidates left instead
            hi = lo + (top - lo) // 2
        while not crept and hi > lo and s.left() > 0:  # the lowest not refuted quickly
            o = s.refute(float(cands[mid]), t_cap, h_cap)
            if o.status == "infeasible":
                lo = mid + 1
            elif o.paths is not None:
                best, best_l = o, s.latency(o.paths)
                hi = min(hi, index(best_l) - 1)
            else:
                hard.add(mid)
                hi = mid
            mid = lo + (hi - lo) // SKEW
        if lo > hi:
            continue
        if recheck and sure < lo and (best is None or hi < top):
            # re-check what the long search rests on now, so that a deadline in it leaves the
            # gap to cands[lo] rather than to the floor (the final re-check, when the search
            # finds cands[lo], is then this one). Not when the search asks for anything
            # better than the best (hi == top): its refutation is re-checked right after it
            o = s.confirm(float(cands[lo - 1]), t_cap, h_cap, nodes=CONFIRM_NODES)
            if o.paths is not None:  # presolve hid it: lo may be false, sure is not
                best, best_l, lo, mid = o, s.latency(o.paths), sure, sure
                continue
            if o.status == "infeasible":
                sure = lo
            else:  # too slow here to repeat at every step
                recheck = False
        o = s.near(float(cands[hi]), start, t_cap, h_cap)  # often far quicker
        if o is None:
            o = s.find(float(cands[hi]), t_cap, h_cap)  # however long it takes
        if o.status == "infeasible":
            lo, crept = hi + 1, True
        elif o.paths is not None:
            best, best_l = o, s.latency(o.paths)
        else:
            break
        mid = lo
    if best is None:
        done = sure >= len(cands)
        return _Stage(None, np.inf, 0.0 if done else np.inf, done)
    top = index(best_l) - 1
    return _Stage(best, best_l, 0.0 if sure > top else _gap(best_l, float(cands[sure])))


def solve_parallel(
    model,
    goal: Goal,
    classes: list[Chains],
    time_limit: float = 60.0,
    differ: list[np.ndarray] | None = None,
) -> Result | None:
    """The lexicographically best placement (see evaluate.best_row), or None when a class has
    too many distinct latencies to search (the caller then uses the per-node MILP)."""
    s = _Search(model, classes, time.perf_counter() + time_limit, differ)
    o = OBJECTIVE[goal.objective]
    caps = {"bottleneck": goal.max_load_ms, "latency": goal.latency_cap, "host": np.inf}
    try:
        first = _least(s, o.primary, caps, None)
        if first.best is None:
            return _none(first, s)
        # the primary held at its optimum; a latency is one a path has, and the bucketed
        # graphs already allow REL_TOL around a latency bound
        held = first.value * (1 + REL_TOL) + 1e-12
        caps[o.primary] = first.value if o.primary == "latency" else min(caps[o.primary], held)
        second = _least(s, o.secondary, caps, first.best)
    except _TooBig:
        return None
    best = second.best if second.best is not None else first.best
    status = "optimal" if first.gap == 0 else "feasible"
    placed = placement(model, classes, best.paths)
    return Result(placed, status, first.gap, s.solves, second.gap, s.cut)


def _least(s: _Search, metric: str, caps: dict[str, float], start: Outcome | None) -> _Stage:
    """The stage that minimizes `metric` (a Metrics field) under the caps on the others."""
    t_cap, lat_cap, h_cap = caps["bottleneck"], caps["latency"], caps["host"]
    if metric == "bottleneck":
        return _min_t(s, lat_cap, t_cap, h_cap)
    if metric == "latency":
        return _min_latency(s, t_cap, h_cap, lat_cap, start)
    return _min_h(s, lat_cap, t_cap)


def _none(first: _Stage, s: _Search) -> Result:
    status = "infeasible" if first.infeasible else "failed: time limit"
    return Result(None, status, first.gap, s.solves, cut=s.cut)
