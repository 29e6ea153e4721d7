"""The MILP of a DAG of parallel chains (branches.py): integer flows, one per class of identical
chains, over its state graph bucketed for a latency bound.

Columns: each expanded arc's flow (how many copies take it), each (class, position, device)
count, then T (the busiest resource's ms per item) and H (host CPU ms per item). Rows: flow
conservation, the counts, T >= each resource's load, H >= host work, memory caps, and for a
runner-up "some copy leaves its path". Counts are integer columns of their own so that HiGHS
bounds them by a resource's capacity (at most 3 decodes fit on this DPU under this T): that is
what refutes a cap below the optimum quickly. scipy is imported here only.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from nicoffload.planner.branches import Bucketed, Chains, bucketed
from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import REL_TOL
from nicoffload.planner.routing import route


@contextlib.contextmanager
def highs_quiet() -> Iterator[None]:
    """HiGHS prints some debug lines with C printf ("transformNewIntegerFeasibleSolution
    tmpSolver.run();") whatever its log options; `plan --json` owns stdout, so while HiGHS
    runs, C-level stdout goes to stderr (process-wide: the planner runs on one thread)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no libc or no fd 1: nothing to guard
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def stopped_at_limit(res) -> bool:
    """Whether HiGHS stopped at a limit: the time limit (scipy's status 1) or the node limit
    (HiGHS's model status 16, which scipy does not name: its status 4 with that message)."""
    return res.status == 1 or (res.status == 4 and "HiGHS Status 16" in str(res.message))


@dataclass
class Outcome:
    status: str  # optimal | feasible (at a limit) | found (no objective) | infeasible | unknown
    # | relaxed (the LP)
    paths: list[np.ndarray] | None  # per class, (copies, length + 1) chain arcs
    value: float  # the objective of the solution (the LP's for `relaxed`)
    bound: float  # proven lower bound of the objective (-inf when none)
    t: float = np.inf  # the solution's busiest resource, ms per item
    h: float = np.inf  # its host CPU ms per item
    stopped: bool = False  # HiGHS stopped at a limit (its node limit, or the time left)


class FlowProblem:
    """The flow MILP of `classes` under one latency bound; solve() varies objective and caps."""

    def __init__(
        self,
        model: CostModel,
        classes: list[Chains],
        suffixes: list,
        bound: float,
        differ: list[np.ndarray] | None = None,
        graphs: list[Bucketed] | None = None,
        scale: float | None = None,
    ) -> None:
        """`graphs`: the classes bucketed for `bound` (built here when None); `scale`: the
        rows' unit (see below; from the model when None). Both only save work."""
        self.model, self.classes = model, classes
        self.graphs: list[Bucketed] = graphs or [
            bucketed(ch, sfx, bound) for ch, sfx in zip(classes, suffixes, strict=True)
        ]
        self.empty = any(g.sink >= g.n_states for g in self.graphs)
        self._steps: dict[int, dict[tuple[int, int], int]] = {}
        self._rows: list[np.ndarray] = []  # (row, col, value) triplets
        self._lo: list[float] = []
        self._hi: list[float] = []
        self._col = 0
        self.offsets: list[int] = []
        self.counts: list[np.ndarray] = []  # count columns of each class
        self.keys: list[np.ndarray] = []  # their position * D + device
        ub: list[np.ndarray] = []
        loads, mems = [], []
        for ch, g in zip(classes, self.graphs, strict=True):
            start = self._col
            counts, load, mem = self._class(ch, g)
            self.offsets.append(start)
            self.counts.append(counts)
            ub.append(np.full(self._col - start, ch.copies))
            loads.append(load)
            mems.append(mem)
        self.n_flow = self._col
        self.T, self.H = self._col, self._col + 1
        self._col += 2
        lc, lr, lv = (np.concatenate(x) for x in zip(*loads, strict=True))
        self.loads = (lc, lr, lv)  # to read T and H off a solution
        # HiGHS accepts a row violated by 1e-6: in units where T is about 1000 that is 1e-9 of
        # it, well inside the REL_TOL every objective is judged by.
        self.scale = scale if scale is not None else row_scale(model, classes)
        self._load_rows(lc, lr, lv * self.scale)
        mc, mv, md = (np.concatenate(x) for x in zip(*mems, strict=True))
        for d in np.flatnonzero(np.isfinite(model.mem_cap)):
            sel = md == d
            self._row(mc[sel], mv[sel], hi=float(model.mem_cap[d]))
        integer = np.r_[np.ones(self.n_flow), 0.0, 0.0]
        upper = np.r_[np.concatenate(ub), np.inf, np.inf]
        if differ is not None:  # some class has a copy off its path: sum of w >= 1
            w = self._col + np.arange(len(classes))
            self._col += len(classes)
            for c, (path, g) in enumerate(zip(differ, self.graphs, strict=True)):
                off = self.offsets[c] + np.flatnonzero(~np.isin(g.arc, path))
                self._row(np.r_[off, w[c]], np.r_[np.ones(len(off)), -1.0], lo=0.0)
            self._row(w, np.ones(len(w)), lo=1.0)
            integer = np.r_[integer, np.ones(len(w))]
            upper = np.r_[upper, np.ones(len(w))]
        from scipy.sparse import csr_matrix

        trip = np.concatenate(self._rows, axis=1)
        self.A = csr_matrix(
            (trip[2], (trip[0].astype(np.intp), trip[1].astype(np.intp))),
            shape=(len(self._lo), self._col),
        )
        self.lo, self.hi = np.array(self._lo), np.array(self._hi)
        self._program = None  # the rows as HiGHS takes them (highs.Program), at the first solve
        self.integer, self.ub, self.nv = integer, upper, self._col
        self.is_arc = np.zeros(self.nv, bool)
        for c, g in enumerate(self.graphs):
            self.is_arc[self.offsets[c] : self.offsets[c] + len(g.arc)] = True
        # what one copy on an arc alone puts on its busiest resource and on the host: an arc
        # over a cap carries no copy under it (_solve fixes it at 0: exact, not a presolve).
        # Only where no arc takes load off the resource (a fused run's delta can be < 0):
        # there an arc's load is a lower bound of the resource's
        sure = ~np.isin(lr, lr[lv < 0])
        self.peak, self.host_work = np.zeros(self.nv), np.zeros(self.nv)
        np.maximum.at(self.peak, lc[sure], lv[sure])
        host = np.r_[model.host, np.zeros(len(model.resources) - len(model.host), bool)]
        if (lv[host[lr]] >= 0).all():
            on = host[lr]
            np.add.at(self.host_work, lc[on], lv[on] * model.divisor[lr[on]])

    def steps(self, c: int) -> dict[tuple[int, int], int]:
        """Class c's graph as (state, chain arc) -> expanded arc (one per pair: routing.py)."""
        if c not in self._steps:
            g = self.graphs[c]
            self._steps[c] = {
                (t, a): e
                for e, (t, a) in enumerate(zip(g.tail.tolist(), g.arc.tolist(), strict=True))
            }
        return self._steps[c]

    def _row(self, cols, vals, lo: float = -np.inf, hi: float = np.inf) -> None:
        r = len(self._lo)
        self._rows.append(np.stack([np.full(len(cols), r), cols, vals]).astype(float))
        self._lo.append(lo)
        self._hi.append(hi)

    def _class(self, ch: Chains, g: Bucketed):
        D = len(self.model.devices)
        E = len(g.arc)
        arcs = self._col + np.arange(E)
        self._col += E
        # conservation: in - out at every state but the sink; the source sends every copy
        first = len(self._lo)
        states = np.concatenate([g.head, g.tail])
        keep = states != g.sink
        signs = np.concatenate([np.ones(E), -np.ones(E)])[keep]
        self._rows.append(np.stack([first + states[keep], np.r_[arcs, arcs][keep], signs]))
        rhs = np.zeros(g.n_states)
        rhs[0] = -ch.copies
        self._lo += list(rhs)
        self._hi += list(rhs)
        # counts: copies whose node at position i is on device d
        pos, dev = ch.pos[g.arc], ch.dev[g.arc]
        into = dev >= 0
        keys, which = np.unique(pos[into] * D + dev[into], return_inverse=True)
        counts = self._col + np.arange(len(keys))
        self._col += len(keys)
        self.keys.append(keys)
        first = len(self._lo)
        self._rows.append(np.stack([first + which, arcs[into], np.ones(into.sum())]))
        self._rows.append(np.stack([first + np.arange(len(keys)), counts, -np.ones(len(keys))]))
        self._lo += [0.0] * len(keys)
        self._hi += [0.0] * len(keys)
        load = ch.load[g.arc] / self.model.divisor
        a, k = np.nonzero(load)
        return (
            counts,
            (arcs[a], k, load[a, k]),
            (arcs[into], ch.mem[g.arc][into], dev[into]),
        )

    def _load_rows(self, lc, lr, lv) -> None:
        model, R, D = self.model, len(self.model.resources), len(self.model.devices)
        used = np.unique(lr)
        row = np.full(R, -1)
        row[used] = len(self._lo) + np.arange(len(used))
        self._rows.append(np.stack([row[lr], lc, lv]))
        self._rows.append(np.stack([row[used], np.full(len(used), self.T), -np.ones(len(used))]))
        self._lo += [-np.inf] * len(used)
        self._hi += [0.0] * len(used)
        host = np.zeros(R, bool)
        host[:D] = model.host
        on = host[lr]
        self._row(np.r_[lc[on], self.H], np.r_[lv[on] * model.divisor[lr[on]], -1.0], hi=0.0)

    def solve(
        self,
        objective: str | None,
        t_cap: float = np.inf,
        h_cap: float = np.inf,
        time_limit: float = 60.0,
        relax: bool = False,
        nodes: int | None = None,
    ) -> Outcome:
        """Minimize "T", "H" or nothing (feasibility) under the caps; `relax`: the LP.
        `nodes`: HiGHS's branch-and-bound node limit (None: none)."""
        integer = np.zeros(self.nv) if relax else self.integer
        # with presolve, though the LP is quicker without it (0.11 against 0.16 s on the
        # 50-node bench's 12 camera resolutions): its bound's last digits then differ, and
        # the caps the search tries from it with them (the 200-node bench's host-cpu search
        # took 16 HiGHS calls instead of 9, 7.6 s against 2.7)
        return self._solve(objective, t_cap, h_cap, time_limit, integer, nodes=nodes)

    def near(
        self,
        paths: list[np.ndarray],
        heavy: list[np.ndarray],
        t_cap: float,
        h_cap: float,
        time_limit: float,
        nodes: int | None = None,
    ) -> Outcome:
        """A solution under the caps with as many copies of each class as `paths` have on each
        device at the `heavy` positions (per class, a bool per position): a far smaller
        search, for an incumbent only ("infeasible" here proves nothing, so it says
        "unknown")."""
        D = len(self.model.devices)
        cols, vals = [], []
        for c, (ch, rows) in enumerate(zip(self.classes, paths, strict=True)):
            devs = ch.dev[rows[:, :-1]]
            for col, key in zip(self.counts[c], self.keys[c], strict=True):
                i, d = divmod(int(key), D)
                if heavy[c][i]:
                    cols.append(col)
                    vals.append(float((devs[:, i] == d).sum()))
        pin = (np.array(cols, np.intp), np.array(vals))
        o = self.find(t_cap, h_cap, time_limit, pin=pin, nodes=nodes)
        if o.status == "infeasible":
            o.status = "unknown"
        return o

    def find(
        self,
        t_cap: float,
        h_cap: float,
        time_limit: float,
        objective: str | None = None,
        pin: tuple[np.ndarray, np.ndarray] | None = None,
        presolve: bool = True,
        nodes: int | None = None,
    ) -> Outcome:
        """A solution under the caps; with an `objective` ("T" or "H"), the least one.
        `presolve=False`: without HiGHS's presolve, which can call a feasible problem
        infeasible (ERGO-Code/HiGHS#2388), to re-check a refutation that a proof rests on.

        HiGHS finds a packing of the counts far sooner with the arcs left fractional; routing
        copies for fixed counts is then quick. With the arcs fractional the problem is a
        relaxation: infeasible, it refutes the MILP; optimal, its value bounds the MILP's, and
        counts routed within that value are the MILP's optimum. Counts that cannot be routed
        so are left to the whole MILP.

        `nodes` bounds each of HiGHS's searches by its node count: a deterministic limit,
        unlike the time left, which only the caller's deadline may spend."""
        import time

        end = time.perf_counter() + time_limit
        integer = np.where(self.is_arc, 0.0, self.integer)
        kw = {"presolve": presolve, "nodes": nodes}
        res = self._solve(objective, t_cap, h_cap, time_limit, integer, fix=pin, raw=True, **kw)
        whole = (objective, t_cap, h_cap)  # the whole MILP's question, if it comes to that
        if isinstance(res, Outcome):
            if res.status == "infeasible" or res.stopped:
                return res  # a relaxation that is infeasible: so is the MILP
            return self._solve(*whole, end - time.perf_counter(), self.integer, fix=pin, **kw)
        bound, exact = -np.inf, objective is not None and res.status == 0
        if objective is not None:
            b = res.fun if exact else getattr(res, "mip_dual_bound", None)
            bound = -np.inf if b is None else float(b) / self.scale
        caps = (t_cap, h_cap)
        if exact:  # route within the relaxation's optimum
            lim = bound * (1 + REL_TOL)
            caps = (min(t_cap, lim), h_cap) if objective == "T" else (t_cap, min(h_cap, lim))
        fix = np.concatenate(self.counts)
        counts = (fix, np.rint(res.x[fix]))
        o = route(self, counts[1], *caps)  # counts that leave no choice: a walk (routing.py)
        if o is None:
            o = self._solve(None, *caps, end - time.perf_counter(), self.integer, fix=counts, **kw)
        if o.paths is not None:
            if objective is None:
                return o
            value = o.t if objective == "T" else o.h
            status = "optimal" if exact else "feasible"
            return Outcome(status, o.paths, value, value if exact else bound, o.t, o.h)
        o = self._solve(*whole, end - time.perf_counter(), self.integer, fix=pin, **kw)
        if objective is not None and o.status != "optimal":
            o.bound = max(o.bound, bound)
        return o

    def _solve(
        self,
        objective,
        t_cap,
        h_cap,
        time_limit,
        integer,
        fix=None,
        raw=False,
        presolve=True,
        nodes=None,
    ):
        if self.empty or t_cap < 0 or h_cap < 0:
            return Outcome("infeasible", None, np.inf, np.inf)
        from nicoffload.planner import highs

        c = np.zeros(self.nv)
        if objective is not None:
            c[{"T": self.T, "H": self.H}[objective]] = 1.0
        lb, ub, _ = self.bounds(t_cap, h_cap)
        if fix is not None:
            lb[fix[0]] = ub[fix[0]] = fix[1]
        options = {"mip_rel_gap": 1e-9, "time_limit": max(time_limit, 0.005), "presolve": presolve}
        if not presolve:  # a re-check, there to refute: a primal heuristic can only find what
            # presolve hid, which the branch and bound finds too. HiGHS's feasibility jump was
            # 0.07-0.1 s of the 0.2-0.25 s re-check of the 50-node bench's throughput optimum
            options["mip_heuristic_run_feasibility_jump"] = False
        if nodes is not None:
            options["node_limit"] = int(nodes)
        if self._program is None:
            self._program = highs.Program(self.A, self.lo, self.hi)
        with highs_quiet():
            res = self._program.run(c, lb, ub, integer, options)
        bound = getattr(res, "mip_dual_bound", None)
        bound = -np.inf if bound is None or objective is None else float(bound) / self.scale
        stopped = stopped_at_limit(res)
        if res.x is None:
            status = "infeasible" if res.status == 2 else "unknown"
            return Outcome(status, None, np.inf, bound, stopped=stopped)
        if raw:
            return res
        if not integer.any():
            return Outcome(
                "relaxed", None, float(res.fun) / self.scale, float(res.fun) / self.scale
            )
        o = self.outcome(res.x, objective)
        o.stopped = stopped
        if objective is None:
            o.bound = bound
        elif res.status == 0:
            o.status, o.bound = "optimal", o.value
        else:
            o.status, o.bound = "feasible", bound
        return o

    def bounds(self, t_cap: float, h_cap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lower, upper, integrality) of the columns under the caps: an arc whose one copy
        alone would pass a cap is fixed at 0 (exact, not a presolve)."""
        ub = self.ub.copy()
        ub[self.T], ub[self.H] = t_cap * self.scale, h_cap * self.scale
        slack = 1 + 4 * REL_TOL  # more than HiGHS's row tolerance (see scale)
        ub[(self.peak > t_cap * slack + 1e-12) | (self.host_work > h_cap * slack + 1e-12)] = 0
        return np.zeros(self.nv), ub, self.integer

    def outcome(self, x: np.ndarray, objective: str | None) -> Outcome:
        """The solution `x` (its flows rounded) as an Outcome: its paths, T and H, the value
        of `objective`; status "found" and no bound (the caller knows what was proven)."""
        x = x.copy()
        x[: self.n_flow] = np.rint(x[: self.n_flow])
        lc, lr, lv = self.loads
        work = np.zeros(len(self.model.resources))
        np.add.at(work, lr, lv * x[lc])
        D = len(self.model.devices)
        t = float(work.max())
        h = float((work[:D] * self.model.divisor[:D])[self.model.host].sum())
        value = {"T": t, "H": h, None: 0.0}[objective]
        return Outcome("found", self.paths(x), value, -np.inf, t, h)

    def paths(self, x: np.ndarray) -> list[np.ndarray]:
        """Split each class's integer flow into one source-to-sink path per copy."""
        out = []
        for c, (ch, g) in enumerate(zip(self.classes, self.graphs, strict=True)):
            flow = np.rint(x[self.offsets[c] : self.offsets[c] + len(g.arc)]).astype(np.int64)
            by_tail: dict[int, list[int]] = {}
            for e in np.flatnonzero(flow):
                by_tail.setdefault(int(g.tail[e]), []).append(int(e))
            paths = np.empty((ch.copies, ch.length + 1), np.intp)
            for j in range(ch.copies):
                s, step = 0, 0
                while s != g.sink:
                    e = next(e for e in by_tail[s] if flow[e] > 0)
                    flow[e] -= 1
                    paths[j, step] = g.arc[e]
                    s, step = int(g.head[e]), step + 1
            out.append(paths)
        return out


def row_scale(model: CostModel, classes: list[Chains]) -> float:
    """The load rows' unit: T of about 1000 (see FlowProblem)."""
    return 1e3 / _typical_load(model, classes)


def _typical_load(model: CostModel, classes: list[Chains]) -> float:
    """About what the busiest resource will carry: the least work of every copy, spread over
    the devices (only a unit for the rows, so a rough figure is enough)."""
    total = 0.0
    for ch in classes:
        w = (ch.load / model.divisor).sum(axis=1)
        best = np.full(ch.n_states, np.inf)
        best[0] = 0.0
        for a in np.argsort(ch.tail, kind="stable"):
            best[ch.head[a]] = min(best[ch.head[a]], best[ch.tail[a]] + w[a])
        total += ch.copies * best[ch.sink]
    typical = total / len(model.devices)
    return typical if np.isfinite(typical) and typical > 0 else 1.0


def placement(model: CostModel, classes: list[Chains], paths: list[np.ndarray]) -> np.ndarray:
    """Device index per node: copy j of a class takes row j of its paths."""
    P = np.full(model.n, -1, dtype=np.intp)
    for ch, rows in zip(classes, paths, strict=True):
        devs = ch.dev[rows[:, :-1]]
        for j, members in enumerate(ch.members):
            P[list(members)] = devs[j]
    return P
