"""Planning time of the exact MILP for a 200-node DAG over 16 devices, with the MILP's gap.

The DAG: 40 image branches (decode -> resize -> center_crop -> normalize) and 40 tokenizers,
the inputs of a multi-camera, multi-caption serving request. The topology: a two-socket host
(cpu0, cpu1), six BlueField-3 DPUs and eight H100-class GPUs behind PCIe, DPUs reaching GPUs by
GPUDirect RDMA. Kernels for every op on every kind; the shipped estimated profiles.

    .venv/bin/python bench/bench_planner.py [--branches 40] [--repeat 3] [--time-limit 60]
        [--objectives throughput,latency,host-cpu] [--limits 0.5,1,2] [--highs-seeds 6]
        [--oracle 8]

Times the solver (`solve_milp`: the proven gap of the objective and of its tie-break) and
what a user waits for: `plan_for`, and `plan_for(explain=True)` as `nicoffload plan` calls
it (the runner-up included).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

IMAGE_OPS = ("decode_image", "resize", "center_crop", "normalize")


def pipeline_yaml(branches: int) -> str:
    lines = ["name: bench-200", "inputs:"]
    for i in range(branches):
        lines.append(
            f"  img{i}: {{kind: bytes, format: jpeg, typical: {{height: 375, width: 500, bytes: 110000}}}}"
        )
        lines.append(f"  txt{i}: {{kind: text, typical: {{chars: 300}}}}")
    lines.append("nodes:")
    outs = []
    for i in range(branches):
        lines += [
            f"  - {{name: dec{i}, op: decode_image, in: img{i}}}",
            f"  - {{name: rs{i}, op: resize, in: dec{i}, params: {{shorter: 256}}}}",
            f"  - {{name: cr{i}, op: center_crop, in: rs{i}, params: {{size: 224}}}}",
            f"  - {{name: nm{i}, op: normalize, in: cr{i}, params: {{mean: [0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2], dtype: float16}}}}",
            f"  - {{name: tk{i}, op: tokenize, in: txt{i}, params: {{max_length: 128}}}}",
        ]
        outs += [
            f"  px{i}: nm{i}",
            f"  ids{i}: tk{i}.input_ids",
            f"  mask{i}: tk{i}.attention_mask",
        ]
    return "\n".join([*lines, "outputs:", *outs, ""])


def topology_yaml() -> str:
    devs = [
        "  cpu0: {kind: cpu, cores: 16, profile: x86-server}",
        "  cpu1: {kind: cpu, cores: 16, profile: x86-server}",
    ]
    links = ["  - {between: [cpu0, cpu1], transport: shm, bandwidth: 40GB/s}"]
    for i in range(6):
        devs.append(f"  dpu{i}: {{kind: dpu, cores: 16, profile: bluefield3-arm}}")
        links.append(f"  - {{between: [dpu{i}, cpu{i // 3}], transport: rdma, bandwidth: 400Gb/s}}")
    for i in range(8):
        devs.append(f"  gpu{i}: {{kind: gpu, profile: h100}}")
        links.append(f"  - {{between: [gpu{i}, cpu{i // 4}], transport: pcie, bandwidth: 64GB/s}}")
    for i in range(6):
        links.append(
            f"  - {{between: [dpu{i}, gpu{i}], transport: rdma-gpudirect, bandwidth: 400Gb/s}}"
        )
    return "\n".join(
        ["name: bench-16", "ingress: dpu0", "egress: gpu0", "devices:", *devs, "links:", *links, ""]
    )


def bench_instance(branches: int):
    """(pipeline, topology, catalog) of the bench: kernels for every op on every kind, the
    fused resize-crop-normalize chain on each."""
    return instance(pipeline_yaml(branches), topology_yaml())


def instance(pipeline_text: str, topology_text: str):
    """(pipeline, topology, catalog) of a pipeline's and a topology's YAML, with the bench's
    catalog (bench_planner_50 uses it too)."""
    from nicoffload.graph import load_pipeline
    from nicoffload.planner.cost import Catalog
    from nicoffload.topology import load_topology

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "p.yaml").write_text(pipeline_text)
        (Path(tmp) / "t.yaml").write_text(topology_text)
        pipeline = load_pipeline(Path(tmp) / "p.yaml")
        topo = load_topology(Path(tmp) / "t.yaml")
    fused = {k: (("resize", "center_crop", "normalize"),) for k in ("cpu", "dpu", "gpu")}
    catalog = Catalog(
        {
            **{op: frozenset({"cpu", "dpu", "gpu"}) for op in IMAGE_OPS},
            "tokenize": frozenset({"cpu", "dpu"}),
        },
        fused,
    )
    return pipeline, topo, catalog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--branches", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60.0, help="per plan, seconds")
    ap.add_argument("--objectives", default="throughput,latency,host-cpu")
    ap.add_argument(
        "--limits",
        default="",
        help="also solve under these time limits, s (e.g. 0.5,1,2): the proven gap a plan cut "
        "short reports (`plan --time-limit`) and how far it really is from the optimum",
    )
    ap.add_argument(
        "--highs-seeds",
        type=int,
        default=0,
        help="also time solve_milp under HiGHS random_seed 0..N-1 (one run each): the time of "
        "one run is one draw of its search order, which moves it 2-4x",
    )
    ap.add_argument(
        "--oracle",
        type=int,
        default=0,
        help="also time, over HiGHS seeds 0..N-1, the least HiGHS work an exact plan needs when "
        "handed the optimum: its final search and the refutations that prove it",
    )
    args = ap.parse_args()

    from nicoffload.planner.cost import build_model
    from nicoffload.planner.evaluate import Goal, evaluate
    from nicoffload.planner.milp import solve_milp
    from nicoffload.planner.solve import plan_for, resolve_profiles

    pipeline, topo, catalog = bench_instance(args.branches)
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    t0 = time.perf_counter()
    model = build_model(pipeline, topo, resolve_profiles(topo), catalog)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    import scipy
    import scipy.optimize  # a CLI run pays this once, before its first DAG

    print(
        f"{len(pipeline.nodes)} nodes, {len(topo.devices)} devices, {len(model.resources)} "
        f"resources; model built in {build_s:.3f} s; scipy.optimize imported in "
        f"{time.perf_counter() - t0:.2f} s (scipy {scipy.__version__}, HiGHS)"
    )
    print(
        f"| objective | solve, median of {args.repeat}: wall / CPU (s) | gap | tie-break gap "
        "| solves | plan_for: wall / CPU (s) | plan_for explain=True: wall / CPU (s) | predicted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for objective in args.objectives.split(","):
        solve_t, plan_t, explain_t, res = [], [], [], None
        for _ in range(args.repeat):
            with _timed(solve_t):
                res = solve_milp(model, Goal(objective), time_limit=args.time_limit)
            for explain, into in ((False, plan_t), (True, explain_t)):
                with _timed(into):
                    plan_for(
                        pipeline,
                        topo,
                        objective=objective,
                        catalog=catalog,
                        explain=explain,
                        time_limit_s=args.time_limit,
                    )
        m = evaluate(model, res.placement[None, :])
        pred = (
            f"{1e3 / m.bottleneck[0]:,.0f} items/s, {m.latency[0]:.3f} ms, "
            f"host {m.host[0]:.3f} ms/item"
        )
        print(
            f"| {objective} | {_med(solve_t)} | {res.gap:.2g} | {res.tie_gap:.2g} "
            f"| {res.solves} | {_med(plan_t)} | {_med(explain_t)} | {pred} |"
        )
    if args.limits:
        _limits(model, args)
    if args.highs_seeds:
        _seeds(model, args)
    if args.oracle:
        _oracle(model, args)
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")


def _limits(model, args) -> None:
    """What a time limit leaves: the gap proven, against the objective's real distance from
    the optimum (the solve without a limit)."""
    from nicoffload.planner.evaluate import Goal, evaluate
    from nicoffload.planner.milp import solve_milp

    key = {"throughput": "bottleneck", "latency": "latency", "host-cpu": "host"}
    tie = {"throughput": "latency", "latency": "bottleneck", "host-cpu": "bottleneck"}
    print(
        "| objective | limit (s) | wall / CPU (s) | gap proven | off the optimum | tie-break gap "
        "proven | tie-break off the best |"
    )
    print("|---|---|---|---|---|---|---|")
    for objective in args.objectives.split(","):
        exact = solve_milp(model, Goal(objective), time_limit=args.time_limit)
        best = evaluate(model, exact.placement[None, :])
        for limit in (float(x) for x in args.limits.split(",")):
            times: list[tuple[float, float]] = []
            with _timed(times):
                res = solve_milp(model, Goal(objective), time_limit=limit)
            m = evaluate(model, res.placement[None, :])

            def off(k: str, m=m, best=best) -> str:  # normalized as the gap: by the plan's
                v = float(getattr(m, k)[0])
                return f"{1 - float(getattr(best, k)[0]) / v:.2%}" if v > 0 else "-"

            print(
                f"| {objective} | {limit:g} | {times[0][0]:.2f} / {times[0][1]:.2f} "
                f"| {res.gap:.2%} | {off(key[objective])} | {res.tie_gap:.2%} "
                f"| {off(tie[objective])} |"
            )


@contextlib.contextmanager
def _seeded(seed: int):
    """HiGHS's random seed set around scipy's milp for the block. The planner passes HiGHS no
    seed (it is pure and its plans do not depend on one); one seed is one draw of HiGHS's
    search order, which moves a search's time 2-4x."""
    import warnings

    import scipy.optimize

    milp = scipy.optimize.milp

    def seeded(*a, options=None, **k):
        return milp(*a, options={**(options or {}), "random_seed": seed}, **k)

    # scipy passes options it does not know (random_seed) to HiGHS as they are, and says so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unrecognized options detected")
        scipy.optimize.milp = seeded
        try:
            yield
        finally:
            scipy.optimize.milp = milp


def _seeds(model, args) -> None:
    """solve_milp's CPU time over HiGHS seeds."""
    from nicoffload.planner.evaluate import Goal
    from nicoffload.planner.milp import solve_milp

    print(
        f"| objective | solve CPU (s) over HiGHS seeds 0..{args.highs_seeds - 1}: median "
        "(min-max) | each | gaps |"
    )
    print("|---|---|---|---|")
    for objective in args.objectives.split(","):
        cpu, gaps = [], set()
        for seed in range(args.highs_seeds):
            with _seeded(seed):
                start = time.process_time()
                res = solve_milp(model, Goal(objective), time_limit=args.time_limit)
                cpu.append(time.process_time() - start)
            gaps.add((res.gap, res.tie_gap))
        each = ", ".join(f"{c:.2f}" for c in cpu)
        print(
            f"| {objective} | {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) "
            f"| {each} | {sorted(gaps)} |"
        )


def _oracle(model, args) -> None:
    """The least HiGHS work an exact plan needs when it is handed the optimum (what the staged
    search spends finding it aside): one search for the final packing and the refutations just
    under it, without presolve (the planner trusts a refutation only so: planner/parallel.py).
    Throughput: the packing at (T*, L*), T refuted just under T*, and the latency candidate
    under L* refuted with T <= T*. Host-cpu: the packing at (H*, T*), H refuted under H* (no
    proof needed when H* = 0), and T refuted just under T* with H <= H*. Per step the median
    and least over seeds, and the sum of the least: what a portfolio of that many HiGHS runs
    racing on as many cores would take, if it cost nothing to race them."""
    import numpy as np

    from nicoffload.planner import parallel
    from nicoffload.planner.branches import chain_classes, suffixes
    from nicoffload.planner.evaluate import REL_TOL, Goal, evaluate
    from nicoffload.planner.milp import solve_milp

    classes = chain_classes(model)
    cands = np.unique(np.concatenate([np.maximum(0.0, suffixes(c)[0]) for c in classes]))
    steps = {
        "throughput": ("packing at (T*, L*)", "T refuted under T*", "L refuted under L*"),
        "host-cpu": ("packing at (H*, T*)", "H refuted under H*", "T refuted under T*"),
    }
    print(f"| objective | step | s over HiGHS seeds 0..{args.oracle - 1}: median (least) |")
    print("|---|---|---|")
    for objective in [o for o in args.objectives.split(",") if o in steps]:
        exact = solve_milp(model, Goal(objective), time_limit=args.time_limit)
        m = evaluate(model, exact.placement[None, :])
        t_star, l_star, h_star = (float(x[0]) for x in (m.bottleneck, m.latency, m.host))
        at = int(np.searchsorted(cands, l_star * (1 + REL_TOL), side="right")) - 1
        t_cap = t_star * (1 + REL_TOL) + 1e-12
        h_cap = h_star * (1 + REL_TOL) + 1e-12
        times = []
        for seed in range(args.oracle):
            s = parallel._Search(model, classes, time.perf_counter() + args.time_limit)
            loose = s.problem(np.inf)
            with _seeded(seed):
                if objective == "throughput":
                    tight = s.problem(float(cands[at]))
                    row = [
                        _search(tight, t_cap, np.inf),
                        _proof(loose, t_star * parallel.BELOW, np.inf),
                        # L* the least any path can have: nothing under it to refute
                        _proof(s.problem(float(cands[at - 1])), t_cap, np.inf) if at else 0.0,
                    ]
                else:
                    row = [
                        _search(loose, t_cap, h_cap),
                        _proof(loose, np.inf, h_star * parallel.BELOW) if h_star > 0 else 0.0,
                        _proof(loose, t_star * parallel.BELOW, h_cap),
                    ]
            times.append(row)
        t = np.array(times)
        for i, name in enumerate(steps[objective]):
            print(f"| {objective} | {name} | {np.median(t[:, i]):.2f} ({t[:, i].min():.2f}) |")
        total = t.sum(axis=1)
        print(
            f"| {objective} | all | {np.median(total):.2f} ({total.min():.2f}); the least of "
            f"each step: {t.min(axis=0).sum():.2f} |"
        )


def _search(problem, t_cap: float, h_cap: float) -> float:
    """Seconds to find a packing under the caps (there is one)."""
    start = time.perf_counter()
    o = problem.find(t_cap, h_cap, 600.0)
    assert o.paths is not None, o.status
    return time.perf_counter() - start


def _proof(problem, t_cap: float, h_cap: float) -> float:
    """Seconds to refute the caps as the planner trusts a refutation (without presolve), the
    faster of its two ways: as a feasibility question, or as the least load under the caps."""
    took = []
    for objective in (None, "T"):
        start = time.perf_counter()
        o = problem.find(t_cap, h_cap, 600.0, objective, presolve=False)
        assert o.status == "infeasible", o.status
        took.append(time.perf_counter() - start)
    return min(took)


@contextlib.contextmanager
def _timed(into: list[tuple[float, float]]):
    """Appends (wall s, this process's CPU s) of the block: on a shared machine the CPU time
    is what the planner itself spent, the wall time what a user waited."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into.append((time.perf_counter() - wall, time.process_time() - cpu))


def _med(runs: list[tuple[float, float]]) -> str:
    wall, cpu = (statistics.median(x) for x in zip(*runs, strict=True))
    return f"{wall:.3f} / {cpu:.3f}"


if __name__ == "__main__":
    main()
