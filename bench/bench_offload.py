"""Does offload pay on this machine? Every placement of one corpus, side by side in one run.

For each placement (all on the host, decode on the DPU, decode+resize+crop on the DPU, all on
the DPU, each DPU one again with host assist, and the planner's throughput and host-cpu plans;
the GPU ones where a GPU is), a
session is opened once (its set-up reported on its own), warmed with one call, then timed over
`--rounds` calls of the whole corpus: items/s, host CPU ms/item (this process), agent CPU
ms/item (the local agent's process, which emulates the DPU on its own cores), and what the plan
predicted beside each; first with `run` (every output copied into one RunResult), then with
`stream` (each batch read in place, as a serving loop does: no copy of the outputs). Ratios are
against the all-host placement of the same run.

    python bench/bench_offload.py [--items 256] [--rounds 2] [--no-assist] [--dpu-link shm|tcp]
        [--only 'all host,decode on dpu'] [--json] [--out FILE.json]

The corpus is ImageNet-size JPEGs (the pipeline's `typical` height and width), from
bench_prediction.typical_jpegs; every placement is priced at the corpus's own sizes (its mean
file bytes and pixels, `sizes.typical_of`), as `run` and `plan --input` price a folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prediction import loadavg, typical_jpegs

import nicoffload
from nicoffload.graph import with_typical
from nicoffload.planner import plan_for, plan_placement
from nicoffload.planner.plan import Plan
from nicoffload.procstat import agent_cpu_s
from nicoffload.sizes import typical_of
from nicoffload.topology import local_topology

PIPELINE = "pipelines/resnet50.yaml"


def placements(pipeline, topology, assist: bool = True) -> dict[str, Plan]:
    def pinned(place: dict[str, str], host_assist: bool = False) -> Plan:
        # priced by the model as the planner prices its own plans: what the run is predicted to do
        return plan_placement(pipeline, place, topology, host_assist=host_assist)

    nodes = [n.name for n in pipeline.nodes]
    out = {"all host": pinned({n: "cpu" for n in nodes})}
    out["decode on dpu"] = pinned({n: "dpu0" if n == "decode" else "cpu" for n in nodes})
    out["decode+resize+crop on dpu"] = pinned({n: "cpu" if n == "norm" else "dpu0" for n in nodes})
    out["all dpu"] = pinned({n: "dpu0" for n in nodes})
    if "gpu0" in topology.ids:
        out["all gpu"] = pinned({n: "gpu0" for n in nodes})
        out["dpu -> gpu"] = pinned({n: "gpu0" if n == "norm" else "dpu0" for n in nodes})
    if assist:  # the DPU placements again, the host taking its share while the agent is busy
        for name in [k for k in out if "dpu" in k]:
            out[f"{name} + host assist"] = pinned(dict(out[name].placement), True)
    for objective in ("throughput", "host-cpu"):
        out[f"plan: {objective}"] = plan_for(pipeline, topology, objective=objective)
    if assist:
        out["plan: throughput, --host-assist"] = plan_for(pipeline, topology, host_assist=True)
    return out


def timed(
    session, images: list[bytes], rounds: int, stream: bool
) -> tuple[float, float, float, Any]:
    """(wall s, host CPU s, agent CPU s, the last call's stats) of `rounds` calls: `run` (every
    output copied into one RunResult) or `stream` (each batch read in place, as a serving loop
    does). Every item must come out ok."""
    cpu0, agent0, t0 = time.process_time(), agent_cpu_s(), time.perf_counter()
    for _ in range(rounds):
        if stream:
            stats = nicoffload.RunStats()
            for batch in session.stream(images, stats):
                assert batch.ok.all(), [f.reason for f in batch.failures]
        else:
            result = session.run(images)
            assert result.ok.all(), result.stats.errors_by_reason
            stats = result.stats
    wall = time.perf_counter() - t0
    return wall, time.process_time() - cpu0, agent_cpu_s() - agent0, stats


def measure(pipeline, plan: Plan, topology, images: list[bytes], rounds: int) -> dict:
    with nicoffload.open(pipeline, plan, topology) as session:
        session.run(images[: max(64, len(images) // 4)])  # warm: kernels, caches, the agent
        items = rounds * len(images)
        wall, host, agent, stats = timed(session, images, rounds, stream=False)
        s_wall, s_host, s_agent, s_stats = timed(session, images, rounds, stream=True)
        pred = plan.predicted
        return {
            "placement": dict(plan.placement),
            "setup_s": round(session.setup_s, 3),
            "items_per_s": round(items / wall, 1),
            "host_cpu_ms_per_item": round(host * 1e3 / items, 3),
            "agent_cpu_ms_per_item": round(agent * 1e3 / items, 3),
            "stream_items_per_s": round(items / s_wall, 1),
            "stream_host_cpu_ms_per_item": round(s_host * 1e3 / items, 3),
            "stream_agent_cpu_ms_per_item": round(s_agent * 1e3 / items, 3),
            "predicted_items_per_s": None if pred is None else round(pred.throughput_per_s, 1),
            "predicted_host_cpu_ms_per_item": None
            if pred is None
            else round(pred.host_cpu_ms_per_item, 3),
            "failover": stats.failover,
            "assisted_share": round(stats.assisted / stats.items, 3) if stats.items else 0.0,
            "planned_host_share": (plan.physical.get(plan.stages[0].name) or {}).get("host_share"),
            # each stage's kernels, measured in the last streamed call against the plan's price
            "stages": {
                name: {
                    k: st.get(k)
                    for k in ("device", "ms_per_item", "predicted_ms_per_item", "error_pct")
                }
                for name, st in s_stats.stages.items()
            },
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument(
        "--no-assist", action="store_true", help="leave out the DPU placements with host assist"
    )
    ap.add_argument(
        "--dpu-link",
        choices=("shm", "tcp"),
        help="what the local agent sends the host over (default: the local topology's, shm)",
    )
    ap.add_argument("--only", help="comma-separated placement names to run, of those above")
    ap.add_argument("--out", type=Path, help="also write the JSON document here")
    args = ap.parse_args()
    pipeline = nicoffload.load_pipeline(PIPELINE)
    topology = local_topology(dpu_link=args.dpu_link)
    hints = dict(pipeline.inputs["image"].hints)
    images = typical_jpegs(args.items, hints.get("height", 375), hints.get("width", 500))
    # priced at this corpus's sizes (its mean file bytes: decode's cost grows with them), as
    # `run` and `plan --input` price a folder, not at the pipeline's `typical`
    typical = typical_of(pipeline, [(str(i), {"image": b}) for i, b in enumerate(images)])
    pipeline = with_typical(pipeline, typical)
    doc = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or '?'})",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "load_before": loadavg(),
        "priced_at": typical,
        "dpu_link": topology.route("dpu0", "cpu")[0].link.transport
        if "dpu0" in topology.ids
        else None,
        "placements": {},
    }
    for name, plan in placements(pipeline, topology, not args.no_assist).items():
        if args.only and name not in args.only.split(","):
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        doc["placements"][name] = measure(pipeline, plan, topology, images, args.rounds)
    doc["load_after"] = loadavg()
    base = doc["placements"]["all host"]
    for row in doc["placements"].values():
        for how in ("", "stream_"):
            row[f"{how}throughput_vs_all_host"] = round(
                row[f"{how}items_per_s"] / base[f"{how}items_per_s"], 3
            )
            row[f"{how}host_cpu_vs_all_host"] = round(
                row[f"{how}host_cpu_ms_per_item"] / base[f"{how}host_cpu_ms_per_item"], 3
            )
        for how in ("", "stream_"):  # the prediction's error: predicted / measured - 1
            for what, pred in (
                ("items_per_s", "predicted_items_per_s"),
                ("host_cpu_ms_per_item", "predicted_host_cpu_ms_per_item"),
            ):
                got = row[f"{how}{what}"]
                row[f"{how}{what}_error"] = (
                    None if row[pred] is None or not got else round(row[pred] / got - 1, 3)
                )
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['machine']}, {doc['date']}, load {doc['load_before']} -> {doc['load_after']}")
    w = max(28, *map(len, doc["placements"]))
    head = f"{'placement':{w}} {'items/s':>8} {'pred':>7} {'x host':>7} {'host ms':>8} {'pred':>6} {'x host':>7} {'agent ms':>8} {'setup s':>7}"
    print(head)
    for name, r in doc["placements"].items():
        print(
            f"{name:{w}} {r['items_per_s']:8.1f} {r['predicted_items_per_s'] or 0:7.0f} "
            f"{r['throughput_vs_all_host']:7.2f} {r['host_cpu_ms_per_item']:8.3f} "
            f"{r['predicted_host_cpu_ms_per_item'] or 0:6.3f} {r['host_cpu_vs_all_host']:7.2f} "
            f"{r['agent_cpu_ms_per_item']:8.3f} {r['setup_s']:7.2f}"
        )
    print("stream() (each batch read in place):")
    print(
        f"{'placement':{w}} {'items/s':>8} {'x host':>7} {'host ms':>8} {'x host':>7} "
        f"{'agent ms':>8} {'pred err: items/s':>17} {'host ms':>8} {'assisted':>8}"
    )

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0%}"

    for name, r in doc["placements"].items():
        print(
            f"{name:{w}} {r['stream_items_per_s']:8.1f} {r['stream_throughput_vs_all_host']:7.2f} "
            f"{r['stream_host_cpu_ms_per_item']:8.3f} {r['stream_host_cpu_vs_all_host']:7.2f} "
            f"{r['stream_agent_cpu_ms_per_item']:8.3f} "
            f"{pct(r['stream_items_per_s_error']):>17} "
            f"{pct(r['stream_host_cpu_ms_per_item_error']):>8} {r['assisted_share']:8.2f}"
        )
    print("each stage's kernels in the last streamed call (ms/item; predicted, err):")
    for name, r in doc["placements"].items():
        parts = [
            f"{st}@{v['device']} {v['ms_per_item']:.3f} ({v['predicted_ms_per_item'] or 0:.3f}, "
            f"{'-' if v['error_pct'] is None else format(v['error_pct'] / 100, '+.0%')})"
            for st, v in r["stages"].items()
        ]
        print(f"{name:{w}} " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
