"""Planning time of a 50-node DAG over a 16-device topology of mixed generations (issue #20).

The DAG: 12 camera branches (decode -> resize -> center_crop -> normalize) and 2 tokenizers.
The topology: one host (cpu0), 7 DPUs of two generations (4 BlueField-3, 3 BlueField-2), 8 GPUs
of two kinds (4 H100, 4 A100), every DPU on the host by RDMA and on its GPU by GPUDirect, every
GPU on the host by PCIe. Kernels for every op on every kind; the shipped estimated profiles.

    .venv/bin/python bench/bench_planner_50.py [--repeat 3] [--time-limit 20]
        [--objectives throughput,latency,host-cpu] [--burners 0]

Per objective: `plan_for` as `nicoffload plan` calls it (explain=True, the runner-up
included): wall and CPU seconds, what the search proved (Plan.search), the predicted figures,
and whether every repeat gave the same plan byte for byte; then the search alone (issue #20's
figure), the calls plan_for makes for it on the same model: `solve_milp` for the plan, then
`search_runner_up` for its runner-up (CPU seconds, median of the repeats; plan_for's other
work, explain's sensitivity scan above all, is left out). `--burners N` runs N busy-loop
processes during the timing (a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import instance

CAMERAS, TOKENIZERS = 12, 2


def camera_sizes(cameras: str) -> list[tuple[int, int, int]]:
    """(height, width, bytes) per camera: 'same', all 375x500 (one class of identical
    branches), or 'mixed', twelve resolutions from 300x400 to 520x730 (twelve classes)."""
    if cameras == "same":
        return [(375, 500, 110_000)] * CAMERAS
    return [(300 + 20 * i, 400 + 30 * i, 80_000 + 10_000 * i) for i in range(CAMERAS)]


def pipeline_yaml(cameras: str = "same", tokenizers: int = TOKENIZERS) -> str:
    lines = ["name: bench-50", "inputs:"]
    for i, (h, w, size) in enumerate(camera_sizes(cameras)):
        lines.append(
            f"  img{i}: {{kind: bytes, format: jpeg, typical: {{height: {h}, width: {w}, bytes: {size}}}}}"
        )
    for i in range(tokenizers):
        lines.append(f"  txt{i}: {{kind: text, typical: {{chars: 300}}}}")
    lines.append("nodes:")
    outs = []
    for i in range(CAMERAS):
        lines += [
            f"  - {{name: dec{i}, op: decode_image, in: img{i}}}",
            f"  - {{name: rs{i}, op: resize, in: dec{i}, params: {{shorter: 256}}}}",
            f"  - {{name: cr{i}, op: center_crop, in: rs{i}, params: {{size: 224}}}}",
            f"  - {{name: nm{i}, op: normalize, in: cr{i}, params: {{mean: [0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2], dtype: float16}}}}",
        ]
        outs.append(f"  px{i}: nm{i}")
    for i in range(tokenizers):
        lines.append(f"  - {{name: tk{i}, op: tokenize, in: txt{i}, params: {{max_length: 128}}}}")
        outs += [f"  ids{i}: tk{i}.input_ids", f"  mask{i}: tk{i}.attention_mask"]
    return "\n".join([*lines, "outputs:", *outs, ""])


def topology_yaml() -> str:
    devs = ["  cpu0: {kind: cpu, cores: 32, profile: x86-server}"]
    links = []
    for i in range(7):
        gen = ("bluefield3-arm", 16) if i < 4 else ("bluefield2-arm", 8)
        devs.append(f"  dpu{i}: {{kind: dpu, cores: {gen[1]}, profile: {gen[0]}}}")
        bw = "400Gb/s" if i < 4 else "200Gb/s"
        links.append(f"  - {{between: [dpu{i}, cpu0], transport: rdma, bandwidth: {bw}}}")
        links.append(
            f"  - {{between: [dpu{i}, gpu{i}], transport: rdma-gpudirect, bandwidth: {bw}}}"
        )
    for i in range(8):
        kind, bw = ("h100", "64GB/s") if i < 4 else ("a100", "32GB/s")
        devs.append(f"  gpu{i}: {{kind: gpu, profile: {kind}}}")
        links.append(f"  - {{between: [gpu{i}, cpu0], transport: pcie, bandwidth: {bw}}}")
    head = ["name: bench-16-mixed", "ingress: dpu0", "egress: gpu0", "devices:"]
    return "\n".join([*head, *devs, "links:", *links, ""])


def bench_instance(cameras: str = "same"):
    """(pipeline, topology, catalog): kernels for every op on every kind, the fused
    resize-crop-normalize chain on each (as bench_planner.py)."""
    return instance(pipeline_yaml(cameras), topology_yaml())


def _proven(search: dict) -> str:
    gap, tie = search.get("gap"), search.get("tie_break_gap")
    if gap is None:
        return "nothing proven"
    if gap > 1e-6:
        return f"gap {gap:.2%}"
    if tie is None or tie > 1e-6:
        return "optimal, tie-break " + ("unproven" if tie is None else f"gap {tie:.2%}")
    return "exact (gap 0, tie-break proven)"


def search_cpu(pipeline, topo, catalog, objective: str, time_limit: float) -> float:
    """CPU seconds of the search plan_for makes for `objective`: the plan's solve_milp, then
    its runner-up's search (proven: the plan's gaps are 0 and nothing was cut)."""
    from nicoffload.planner.cost import build_model
    from nicoffload.planner.evaluate import Goal
    from nicoffload.planner.milp import solve_milp
    from nicoffload.planner.runner_up import search_runner_up
    from nicoffload.planner.solve import allowed_mask, resolve_profiles

    model = build_model(pipeline, topo, resolve_profiles(topo), catalog)
    allowed = allowed_mask(pipeline, topo, model)
    goal = Goal(objective)
    start = time.process_time()
    result = solve_milp(model, goal, allowed, time_limit=time_limit)
    if result.placement is not None:
        proven = max(result.gap, result.tie_gap) <= 1e-6 and not result.cut
        search_runner_up(model, goal, result.placement, allowed, time_limit, proven)
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=20.0, help="per plan, seconds")
    ap.add_argument("--objectives", default="throughput,latency,host-cpu")
    ap.add_argument("--burners", type=int, default=0, help="busy-loop processes while timing")
    ap.add_argument(
        "--cameras",
        default="same",
        choices=("same", "mixed"),
        help="same: 12 identical cameras; mixed: 12 resolutions (12 classes of branches)",
    )
    args = ap.parse_args()

    import scipy
    import scipy.optimize  # a CLI run pays this once, before its first DAG

    from nicoffload.errors import PlanError
    from nicoffload.planner.solve import plan_for

    pipeline, topo, catalog = bench_instance(args.cameras)
    burners = [
        subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)
    ]
    try:
        print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
        print(
            f"{len(pipeline.nodes)} nodes ({args.cameras} cameras), {len(topo.devices)} devices; scipy "
            f"{scipy.__version__}; {args.burners} burner processes; limit {args.time_limit:g} s"
        )
        print(
            f"| objective | plan, median of {args.repeat}: wall / CPU (s) | each wall (s) "
            "| proven | HiGHS solves | same plan every run | predicted | search alone: CPU (s) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for objective in args.objectives.split(","):
            wall, cpu, docs, plan, error = [], [], set(), None, None
            for _ in range(args.repeat):
                w, c = time.perf_counter(), time.process_time()
                try:
                    plan = plan_for(
                        pipeline,
                        topo,
                        objective=objective,
                        catalog=catalog,
                        explain=True,
                        time_limit_s=args.time_limit,
                    )
                    doc = plan.to_json()
                    doc["search"].pop("seconds", None)  # a clock reading (older plans)
                    docs.add(json.dumps(doc, sort_keys=True))
                except PlanError as exc:
                    error = str(exc)
                    docs.add(error)
                wall.append(time.perf_counter() - w)
                cpu.append(time.process_time() - c)
            each = ", ".join(f"{x:.2f}" for x in wall)
            med = f"{statistics.median(wall):.3f} / {statistics.median(cpu):.3f}"
            alone = [
                search_cpu(pipeline, topo, catalog, objective, args.time_limit)
                for _ in range(args.repeat)
            ]
            searched = f"{statistics.median(alone):.3f} ({', '.join(f'{x:.2f}' for x in alone)})"
            if plan is None:
                print(
                    f"| {objective} | {med} | {each} | {error} | - | {len(docs) == 1} | - "
                    f"| {searched} |"
                )
                continue
            p = plan.predicted
            pred = (
                f"{p.throughput_per_s:,.0f} items/s, {p.latency_ms:.3f} ms, "
                f"host {p.host_cpu_ms_per_item:.3f} ms/item"
            )
            print(
                f"| {objective} | {med} | {each} | {_proven(plan.search)} "
                f"| {plan.search.get('solves', '-')} | {len(docs) == 1} | {pred} | {searched} |"
            )
        print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")
    finally:
        for b in burners:
            b.kill()
            b.wait()


if __name__ == "__main__":
    main()
