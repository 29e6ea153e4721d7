"""The planner's own MILP calls on Gurobi instead of HiGHS, on bench_planner.py's 200-node DAG.

Is the plan time of that DAG HiGHS's, or the instance's? This runs the same planner code with
`scipy.optimize.milp` answered by Gurobi (same matrices, bounds, time limits, gap; scipy's
`presolve: False` as Gurobi's `Presolve=0`), one thread like HiGHS's MIP search:

    pip install gurobipy   # not a dependency of nicoffload; its pip license is size-limited
    .venv/bin/python bench/engine_gurobi.py [--repeat 3] [--threads 1]

That license takes at most 2000 variables and 2000 constraints. The latency stages' problems
(the flow bucketed by latency) are larger, so this times what fits: the whole host-cpu plan,
the throughput plan's load stage (its primary objective), and that objective as one MILP.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np


def gurobi_milp(threads: int):
    """A function with scipy.optimize.milp's signature and result fields, solved by Gurobi."""
    import gurobipy as gp
    import scipy.sparse as sp
    from gurobipy import GRB

    env = gp.Env(params={"OutputFlag": 0, "Threads": threads})

    def milp(c, integrality=None, bounds=None, constraints=None, options=None):
        options = options or {}
        cons = constraints if isinstance(constraints, list) else [constraints]
        A = sp.vstack([sp.csr_matrix(k.A) for k in cons]).tocsr()
        lo = np.concatenate([np.broadcast_to(k.lb, (k.A.shape[0],)) for k in cons])
        hi = np.concatenate([np.broadcast_to(k.ub, (k.A.shape[0],)) for k in cons])
        n = len(c)
        lb = np.broadcast_to(bounds.lb, (n,)).astype(float)
        ub = np.broadcast_to(bounds.ub, (n,)).astype(float)
        integer = np.broadcast_to(integrality, (n,)) > 0
        m = gp.Model(env=env)
        x = m.addMVar(
            n,
            lb=lb,
            ub=np.where(np.isinf(ub), GRB.INFINITY, ub),
            vtype=np.where(integer, GRB.INTEGER, GRB.CONTINUOUS),
        )
        m.setObjective(np.asarray(c) @ x)
        eq = lo == hi
        for rows, sense in ((eq, "="), (np.isfinite(lo) & ~eq, ">"), (np.isfinite(hi) & ~eq, "<")):
            if rows.any():
                expr = A[rows] @ x
                rhs = lo[rows] if sense != "<" else hi[rows]
                m.addConstr(
                    expr == rhs if sense == "=" else (expr >= rhs if sense == ">" else expr <= rhs)
                )
        m.Params.TimeLimit = max(1e-3, float(options.get("time_limit", 1e9)))
        m.Params.MIPGap = options.get("mip_rel_gap", 1e-4)
        if options.get("presolve") is False:
            m.Params.Presolve = 0
        m.optimize()
        found = m.SolCount > 0
        status = {GRB.OPTIMAL: 0, GRB.TIME_LIMIT: 1, GRB.INFEASIBLE: 2, GRB.INF_OR_UNBD: 2}
        code = status.get(m.Status, 4)
        bound = None
        if integer.any() and (found or m.Status == GRB.TIME_LIMIT):
            bound = m.ObjBound
        elif found:
            bound = m.ObjVal
        return SimpleNamespace(
            status=code,
            success=code == 0,
            x=x.X if found else None,
            fun=m.ObjVal if found else None,
            mip_dual_bound=bound,
            mip_gap=m.MIPGap if integer.any() and found else 0.0,
            message=f"Gurobi status {m.Status}",
        )

    return milp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import gurobipy
    import scipy.optimize
    from bench_planner import bench_instance

    from nicoffload.planner import parallel
    from nicoffload.planner.branches import chain_classes
    from nicoffload.planner.cost import build_model
    from nicoffload.planner.evaluate import Goal, evaluate
    from nicoffload.planner.milp import solve_milp
    from nicoffload.planner.solve import resolve_profiles

    pipeline, topo, catalog = bench_instance(40)
    model = build_model(pipeline, topo, resolve_profiles(topo), catalog)
    classes = chain_classes(model)
    print(f"Gurobi {'.'.join(map(str, gurobipy.gurobi.version()))}, {args.threads} thread(s)")
    print(f"| engine | what | wall s, median of {args.repeat} (each) | result |")
    print("|---|---|---|---|")
    highs = scipy.optimize.milp
    for engine, milp in (("HiGHS (scipy)", highs), ("Gurobi", gurobi_milp(args.threads))):
        scipy.optimize.milp = milp
        try:
            runs = {
                "host-cpu plan (solve_milp)": lambda: _plan(
                    solve_milp(model, Goal("host-cpu")), model, evaluate
                ),
                "throughput load stage (parallel._min_t)": lambda: _stage(parallel, model, classes),
                "throughput as one MILP (min T)": lambda: _one(parallel, model, classes),
            }
            for what, run in runs.items():
                took, out = [], None
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    out = run()
                    took.append(time.perf_counter() - start)
                each = ", ".join(f"{t:.2f}" for t in took)
                print(f"| {engine} | {what} | {statistics.median(took):.2f} ({each}) | {out} |")
        finally:
            scipy.optimize.milp = highs


def _plan(res, model, evaluate) -> str:
    m = evaluate(model, res.placement[None, :])
    return f"T {m.bottleneck[0]:.6f}, H {m.host[0]:.3f}; gap {res.gap:.2g}, tie-break gap {res.tie_gap:.2g}"


def _stage(parallel, model, classes) -> str:
    s = parallel._Search(model, classes, time.perf_counter() + 60)
    stage = parallel._min_t(s, np.inf, np.inf, np.inf)
    return f"T {stage.value:.6f}, gap {stage.gap:.2g}"


def _one(parallel, model, classes) -> str:
    s = parallel._Search(model, classes, time.perf_counter() + 60)
    o = s.problem(np.inf).solve("T", np.inf, np.inf, 60.0)
    return f"T {o.t:.6f}, {o.status} (presolve on, not re-checked)"


if __name__ == "__main__":
    main()
