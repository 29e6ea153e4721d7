"""Exact placement of a DAG as a mixed-integer program (scipy.optimize.milp, HiGHS).

x[v,d] = 1 places node v on device d. Products of placements are linearized exactly:
  z[g,d]  = fused group g runs on d: its nodes on d, and their run starts and ends where the
            runtime's greedy takes g (`fusion`): an AND of x and 1 - x literals, one per cell
            of the group's table (z <= each literal, z >= their sum - (count - 1))
  y[r,d]  = tensor r must be delivered to device d     (y >= x[consumer,d] - x[src,d])
  q[r,k]  = load tensor r puts on resource k            (q >= sum_d load[s,d,k] y[r,d] - M (1 - x[src,s]))
  e[r,c]  = transfer time of r to its consumer c        (same form, with route times)
  t[v]    = time node v may start; L >= t + node time + delivery for every output.
Lexicographic: the primary objective, then the secondary with the primary held at its optimum.
scipy is imported here only, when a DAG is planned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import OBJECTIVE, REL_TOL, Goal

BIG = 1e9


@dataclass
class MilpResult:
    placement: np.ndarray | None
    status: str
    gap: float  # relative MIP gap HiGHS reports for the primary solve (0 when proven optimal)
    solves: int
    tie_gap: float = 0.0  # the same for the secondary (tie-break); inf when it was not run
    cut: bool = False  # the time limit was reached: the search did not run to its end


class _Builder:
    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, lb: float = 0.0, ub: float = np.inf, integer: bool = False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(int(integer))
        return len(self.lb) - 1

    def row(self, coefs: dict[int, float], lo: float = -np.inf, hi: float = np.inf) -> None:
        self.rows.append((coefs, lo, hi))


def _add(into: dict[int, float], col: int, value: float) -> None:
    if value:
        into[col] = into.get(col, 0.0) + value


def _grouped(rows: np.ndarray, sources: list[int]) -> list[tuple[list[int], np.ndarray]]:
    """Sources whose rows are equal share one constraint (a tree link: one per side)."""
    groups: dict[bytes, tuple[list[int], np.ndarray]] = {}
    for s in sources:
        key = np.round(rows[s], 15).tobytes()
        groups.setdefault(key, ([], rows[s]))[0].append(s)
    return list(groups.values())


def _terms(g, n: int) -> list[tuple[list[int], list[int]]]:
    """When group g runs fused on a device, as disjoint cases (nodes on it, nodes not on it):
    one case per true cell of its table (the run's start and end), a row of cells that holds
    for every end as one case."""
    i, j = g.nodes[0], g.nodes[-1]
    if g.rows is None or g.rows.all():
        return [(list(g.nodes), [])]
    out = []
    last_r, last_c = g.rows.shape[0] - 1, g.rows.shape[1] - 1
    for r in range(last_r + 1):
        s = g.s0 + r  # r == 0: the run starts at s0 or before
        head = (list(range(s, i)), [s - 1] if r and s > 0 else [])
        cells = [c for c in range(last_c + 1) if g.rows[r, c]]
        if len(cells) == last_c + 1:
            out.append((head[0] + list(g.nodes), head[1]))
            continue
        for c in cells:
            e = j + c  # c == last_c: the run ends there or after
            tail = [e + 1] if c < last_c and e + 1 < n else []
            out.append((head[0] + list(range(i, e + 1)), head[1] + tail))
    return out


def _add_fused(b: _Builder, model: CostModel, x: dict, work: list, node_ms: list) -> None:
    """Each fused group's delta on each device, where the placement fuses it (z[g,d])."""
    for g in model.groups:
        for d in range(len(model.devices)):
            if np.isnan(g.delta[d]) or not g.delta[d] or not all((v, d) in x for v in g.nodes):
                continue
            for on, off in _terms(g, model.n):
                if not all((v, d) in x for v in on):
                    continue
                off = [v for v in off if (v, d) in x]  # a node that cannot be on d is not
                z = b.var(0, 1)
                for v in on:
                    b.row({z: 1.0, x[v, d]: -1.0}, hi=0.0)
                for v in off:
                    b.row({z: 1.0, x[v, d]: 1.0}, hi=1.0)
                coefs = {z: 1.0, **{x[v, d]: -1.0 for v in on}, **{x[v, d]: 1.0 for v in off}}
                b.row(coefs, lo=1.0 - len(on))
                _add(work[d], z, g.delta[d])
                _add(node_ms[g.nodes[-1]], z, g.delta[d])


def _add_serial(b: _Builder, model: CostModel, x: dict, T: int) -> None:
    """T >= the host process's serial time (`evaluate.serial_load`): each stage's serial ms on
    its device, a stage starting at node v on d where v is on d and node v - 1 (topological
    order, as `plan.stages_for` cuts) is not: s[v,d] >= x[v,d] - x[v-1,d]. Row 0 of
    `model.serial` on the runtime's fast path, row 1 on the general one: binary g = 1 unless
    the placement has the fast path's shape (`evaluate.fast_path`: a DPU stage only first, a
    GPU stage only last), and w[v,d] = s[v,d] AND g carries the general path's difference."""
    if model.serial is None or not np.any(model.serial):
        return
    n, D = model.n, len(model.devices)
    kinds = model.kinds or ("cpu",) * D  # no kinds: every placement on the fast path
    fast, general = model.serial[0], model.serial[1]
    g = b.var(0, 1, True) if np.any(general != fast) else None
    if g is not None:
        # g = OR of the general path's causes, each z = x[v,d] AND NOT x[u,d]: bounded below by
        # each (g >= x[v,d] - x[u,d]) and above by their sum, so that where the general path's
        # figure is the cheaper a plan of the fast path's shape cannot pay it
        causes = []
        for (v, d), col in x.items():
            if kinds[d] == "dpu" and v > 0:  # a DPU stage that does not come first
                u: tuple[int, int] | None = (v - 1, d)
            elif kinds[d] == "gpu" and v < n - 1:  # a GPU stage that something follows
                u = (v + 1, d)
            elif kinds[d] not in ("cpu", "dpu", "gpu"):
                u = None
            else:
                continue
            other = {x[u]: 1.0} if u is not None and u in x else {}
            b.row({g: 1.0, col: -1.0, **other}, lo=0.0)
            z = b.var(0, 1)
            b.row({z: 1.0, col: -1.0}, hi=0.0)
            if other:
                b.row({z: 1.0, **other}, hi=1.0)
            causes.append(z)
        b.row({g: 1.0, **{z: -1.0 for z in causes}}, hi=0.0)
    row = {T: 1.0}
    for (v, d), col in x.items():
        if not (fast[d] or general[d]):
            continue
        st = b.var(0, 1)  # s[v,d]: a stage starts at v on d
        b.row({st: 1.0, col: -1.0, **({x[v - 1, d]: 1.0} if (v - 1, d) in x else {})}, lo=0.0)
        _add(row, st, -fast[d])
        if g is not None and general[d] != fast[d]:
            w = b.var(0, 1)  # s AND g
            b.row({w: 1.0, st: -1.0, g: -1.0}, lo=-1.0)
            b.row({w: 1.0, st: -1.0}, hi=0.0)
            b.row({w: 1.0, g: -1.0}, hi=0.0)
            _add(row, w, -(general[d] - fast[d]))
    b.row(row, lo=0.0)


def _formulate(model: CostModel, goal: Goal, allowed: np.ndarray, exclude: np.ndarray | None):
    b = _Builder()
    n, D, R = model.n, len(model.devices), len(model.resources)
    x = {(v, d): b.var(0, 1, True) for v in range(n) for d in range(D) if allowed[v, d]}
    work = [dict() for _ in range(R)]  # resource -> linear expression of its work
    node_ms: list[dict[int, float]] = [dict() for _ in range(n)]
    for (v, d), col in x.items():
        _add(work[d], col, model.cost[v, d])
        _add(node_ms[v], col, model.cost[v, d])
    for v, d, k, ms in model.side:  # `planner.side`: what node v on d costs resource k
        if (v, d) in x:
            _add(work[k], x[v, d], ms)
    for v in range(n):
        b.row({x[v, d]: 1.0 for d in range(D) if (v, d) in x}, 1.0, 1.0)
    _add_fused(b, model, x, work, node_ms)
    start = [b.var() for _ in range(n)]
    L = b.var()
    for r in model.refs:
        fixed = r.src < 0
        srcs = [model.ingress] if fixed else [d for d in range(D) if allowed[r.src, d]]
        need: dict[int, dict[int, float]] = {}  # destination -> lower bounds of y
        y = {}
        for d in range(D):
            wants = [c for c in r.consumers if allowed[c, d]]
            if (not wants and not (r.output and d == model.egress)) or (
                fixed and d == model.ingress
            ):
                continue
            y[d] = b.var(0, 1)
            src_here = {} if fixed or (r.src, d) not in x else {x[r.src, d]: 1.0}
            for c in wants:
                b.row({y[d]: 1.0, x[c, d]: -1.0, **src_here}, lo=0.0)
            if r.output and d == model.egress:
                b.row({y[d]: 1.0, **src_here}, lo=1.0)
            need[d] = src_here
        for k in range(R):
            rows = model.ref_load(r)[:, :, k]
            if not any(rows[s, d] for s in srcs for d in y):
                continue
            if fixed:
                for d, col in y.items():
                    _add(work[k], col, rows[model.ingress, d])
                continue
            q = b.var()
            _add(work[k], q, 1.0)
            for group, row in _grouped(rows, srcs):
                big = sum(row[d] for d in y)
                coefs = {q: 1.0}
                for d, col in y.items():
                    _add(coefs, col, -row[d])
                for s in group:
                    _add(coefs, x[r.src, s], -big)
                b.row(coefs, lo=-big)
        for c in r.consumers:
            times = np.array([[model.ref_time(r, s, d) for d in range(D)] for s in range(D)])
            # start[c] >= start[src] + node time of src + transfer time
            coefs = {start[c]: 1.0}
            if fixed:
                for d in range(D):
                    if (c, d) in x:
                        _add(coefs, x[c, d], -times[model.ingress, d])
                b.row(coefs, lo=0.0)
                continue
            e = b.var()
            coefs.update({start[r.src]: -1.0, e: -1.0})
            for col, ms in node_ms[r.src].items():
                _add(coefs, col, -ms)
            b.row(coefs, lo=0.0)
            for group, row in _grouped(times, srcs):
                big = max(row[d] for d in range(D) if (c, d) in x)
                coefs = {e: 1.0}
                for d in range(D):
                    if (c, d) in x:
                        _add(coefs, x[c, d], -row[d])
                for s in group:
                    _add(coefs, x[r.src, s], -big)
                b.row(coefs, lo=-big)
        if r.output and not fixed:
            coefs = {L: 1.0, start[r.src]: -1.0}
            for col, ms in node_ms[r.src].items():
                _add(coefs, col, -ms)
            for s in srcs:
                _add(coefs, x[r.src, s], -model.ref_time(r, s, model.egress))
            b.row(coefs, lo=0.0)
    T = b.var()
    for k in range(R):
        b.row({T: 1.0, **{c: -v / model.divisor[k] for c, v in work[k].items()}}, lo=0.0)
    _add_serial(b, model, x, T)
    H = b.var()
    host = {}
    for d in np.flatnonzero(model.host):
        for c, v in work[d].items():
            _add(host, c, -v)
    b.row({H: 1.0, **host}, lo=0.0)
    for d in range(D):
        if np.isfinite(model.mem_cap[d]):
            b.row({x[v, d]: model.mem[v] for v in range(n) if (v, d) in x}, hi=model.mem_cap[d])
    if np.isfinite(goal.max_load_ms):
        b.row({T: 1.0}, hi=goal.max_load_ms)
    if np.isfinite(goal.latency_cap):
        b.row({L: 1.0}, hi=goal.latency_cap)
    if exclude is not None:
        b.row({x[v, int(d)]: 1.0 for v, d in enumerate(exclude)}, hi=n - 1)
    column = {"bottleneck": T, "latency": L, "host": H}
    o = OBJECTIVE[goal.objective]
    return b, x, (column[o.primary], column[o.secondary])


def solve_milp(
    model: CostModel,
    goal: Goal,
    allowed: np.ndarray | None = None,
    exclude: np.ndarray | None = None,
    time_limit: float = 60.0,
    exclude_optimal: bool = False,
) -> MilpResult:
    """The best placement (lexicographic primary, secondary), optionally not `exclude`.

    A DAG of parallel chains is solved by branch classes (parallel.py); any other DAG by the
    per-node program below. `time_limit` is for the whole call. `exclude_optimal`: `exclude`
    is proven optimal, so a placement that ties with it is the answer (ties.py).
    """
    allowed = model.allowed if allowed is None else allowed & model.allowed
    if not allowed.any(axis=1).all():
        return MilpResult(None, "infeasible", 0.0, 0)
    fast = _solve_branches(model, goal, allowed, exclude, time_limit, exclude_optimal)
    if fast is not None and not _serial_binds(model, goal, fast.placement):
        return fast
    tie = _tie(model, goal, allowed, exclude, exclude_optimal)
    if tie is not None:
        return tie
    return solve_nodes(model, goal, allowed, exclude, time_limit)


def _serial_binds(model: CostModel, goal: Goal, placement: np.ndarray | None) -> bool:
    """Whether the host process's serial time (which the branch classes' program leaves out)
    raises `placement`'s bottleneck: then its optimum is not shown to be the true one, and the
    per-node program (which prices it) decides. Otherwise the placement's figures are those
    that program optimized, and no placement's can be lower: it is the true optimum."""
    if placement is None or model.serial is None or not np.any(model.serial):
        return False
    from nicoffload.planner.evaluate import evaluate

    m = evaluate(model, placement[None, :])
    return bool(m.serial[0] > float(m.load[0].max()) * (1 + REL_TOL) + 1e-12)


def _tie(
    model: CostModel, goal: Goal, allowed: np.ndarray, exclude: np.ndarray | None, optimal: bool
) -> MilpResult | None:
    """A placement tying with an optimal `exclude` (ties.py), as a result; None when none."""
    if exclude is None or not optimal:
        return None
    from nicoffload.planner.ties import tied_neighbour

    tie = tied_neighbour(model, goal, exclude, allowed)
    return None if tie is None else MilpResult(tie, "optimal", 0.0, 0)


def solve_nodes(
    model: CostModel,
    goal: Goal,
    allowed: np.ndarray | None = None,
    exclude: np.ndarray | None = None,
    time_limit: float = 60.0,
) -> MilpResult:
    """solve_milp by the per-node program, whatever the DAG's shape."""
    import time

    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    from nicoffload.planner.flow import highs_quiet

    allowed = model.allowed if allowed is None else allowed & model.allowed
    if not allowed.any(axis=1).all():
        return MilpResult(None, "infeasible", 0.0, 0)
    deadline = time.perf_counter() + time_limit
    b, x, (primary, secondary) = _formulate(model, goal, allowed, exclude)
    data, ri, ci, lo, hi = [], [], [], [], []
    for i, (coefs, a, z) in enumerate(b.rows):
        for c, v in coefs.items():
            ri.append(i)
            ci.append(c)
            data.append(v)
        lo.append(a)
        hi.append(z)
    nv = len(b.lb)
    A = coo_matrix((data, (ri, ci)), shape=(len(b.rows), nv)).tocsr()
    bounds = Bounds(np.array(b.lb), np.array(b.ub))
    solves, gap, tie_gap, extra, cut = 0, 0.0, np.inf, [], False
    for which, key in enumerate((primary, secondary)):
        if which == 1 and gap > 1e-6:
            break  # ties of an unproven primary are not ties: keep its plan, say so
        c = np.zeros(nv)
        c[key] = 1.0
        cons = [LinearConstraint(A, np.array(lo), np.array(hi)), *extra]
        # HiGHS's presolve can call a feasible problem infeasible (ERGO-Code/HiGHS#2388) or
        # fail on it ("Solve error", status 4, seen on fused-group terms): either is believed
        # only once HiGHS says it without presolve too
        for presolve in (True, False):
            left = max(0.01, deadline - time.perf_counter())
            options = {"mip_rel_gap": 1e-9, "time_limit": left, "presolve": presolve}
            with highs_quiet():
                res = milp(
                    c,
                    constraints=cons,
                    integrality=np.array(b.integer),
                    bounds=bounds,
                    options=options,
                )
            solves += 1
            if res.status not in (2, 4):
                break
        cut = cut or res.status == 1  # no node limit here: HiGHS stopped at the time limit
        if res.x is None:
            status = "infeasible" if res.status == 2 else f"failed: {res.message}"
            if which == 0:
                return MilpResult(None, status, np.inf, solves, cut=cut)
            break
        best = res.x
        if which == 1:
            tie_gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
        if which == 0:
            gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
            row = np.zeros(nv)
            row[primary] = 1.0
            extra = [LinearConstraint(row[None, :], -np.inf, res.x[primary] * (1 + REL_TOL) + 1e-9)]
    placement = np.full(model.n, -1, dtype=np.intp)
    for (v, d), col in x.items():
        if best[col] > 0.5:
            placement[v] = d
    return MilpResult(placement, "optimal", gap, solves, tie_gap, cut)


def _solve_branches(
    model: CostModel,
    goal: Goal,
    allowed: np.ndarray,
    exclude: np.ndarray | None,
    limit: float,
    exclude_optimal: bool = False,
) -> MilpResult | None:
    """Parallel chains as branch classes, or None when the DAG is not made of chains."""
    from nicoffload.planner.branches import chain_classes, class_members
    from nicoffload.planner.parallel import solve_parallel

    masked = replace(model, cost=np.where(allowed, model.cost, np.inf))
    members = class_members(masked)
    if members is None:
        return None
    differ = None
    if exclude is not None:
        for copies in members:  # two copies placed differently: swapped, they tie with `exclude`
            rows = exclude[np.array(copies)]
            other = np.flatnonzero(np.any(rows != rows[0], axis=1))
            if len(other):
                swapped = exclude.copy()
                a, b = list(copies[0]), list(copies[other[0]])
                swapped[a], swapped[b] = exclude[b], exclude[a]
                return MilpResult(swapped, "optimal", 0.0, 0)
        tie = _tie(model, goal, allowed, exclude, exclude_optimal)  # after the swap: cheaper
        if tie is not None:
            return tie
    classes = chain_classes(masked)
    assert classes is not None
    if exclude is not None:
        try:
            differ = [ch.path_of(exclude[list(ch.members[0])]) for ch in classes]
        except StopIteration:  # `exclude` is not a placement these classes can take
            differ = None
    result = solve_parallel(masked, goal, classes, limit, differ)
    if result is None:
        return None
    return MilpResult(
        result.placement, result.status, result.gap, result.solves, result.tie_gap, result.cut
    )
