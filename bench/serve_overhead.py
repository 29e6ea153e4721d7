"""What `serve --fronts F` costs its Session's process per request, besides the kernels: its CPU
by thread over a run of load (closed loop of `--concurrency` clients, or open loop at
`--rate`), less the runtime's host workers. The host-only plan on small JPEGs (`--size`), so
that the kernels are cheap and the load high enough for a front's requests to group; several
`--tree`s (other checkouts: before and after a change) and `--loops` (the event loop of the
fronts and the load processes, `eventloop.ENV`: `uvloop`, or `uvloop/asyncio` for the fronts'
and the load processes' apart) interleaved, `--rounds` times, so that each
sees the same machine. The load processes' CPU per request beside it.

    python bench/serve_overhead.py [--tree DIR ..] [--loops asyncio,uvloop] [--fronts 2]
                                   [--concurrency 32 | --rate R] [--seconds 10] [--rounds 2]
                                   [--size 96x128] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prediction import loadavg, typical_jpegs
from serve_fronts import WORKERS
from serve_load import PIPELINE, ROOT, Serve, Target, load

import nicoffload
from nicoffload.planner import plan_placement
from nicoffload.serve import eventloop
from nicoffload.serve import loadgen as lg
from nicoffload.topology import local_topology


def _loop_env(name: str) -> None:
    if name:
        os.environ[eventloop.ENV] = name
    else:
        os.environ.pop(eventloop.ENV, None)


def one(
    tree: Path, loop: str | None, plan: Path, images: list[bytes], args: Any, folder: Path
) -> dict[str, Any]:
    """One server from `tree`, its fronts and the load processes on `loop` ("F" or
    "F/L": the fronts' and the load processes'; None: their default), loaded for --seconds
    after a warm-up."""
    front_loop, _, load_loop = (loop or "").partition("/")
    _loop_env(front_loop)  # serve's fronts inherit it
    more = ("--fronts", str(args.fronts), "--max-queue", "4096", "--front-slots", "64")
    log = folder / f"serve-{len(list(folder.iterdir()))}.log"
    s = Serve(plan, log, more=more, tree=tree)
    _loop_env(load_loop or front_loop)  # and the load processes, spawned now
    pool = lg.pool(args.procs)
    try:
        t = Target(s.doc["url"], [lg.request_body("image", [b]) for b in images], pool, args.procs)
        load(t, 2.0, rate=args.rate, conc=args.concurrency)  # warm-up
        cpu0, threads0, fronts0 = s.cpu()[0], s.threads(), s.fronts_cpu()
        r = load(t, args.seconds, rate=args.rate, conc=args.concurrency)
        cpu1, threads1, fronts1 = s.cpu()[0], s.threads(), s.fronts_cpu()
    finally:
        pool.shutdown()
        s.stop()
    ok = max(1, r["ok"])
    by = {k: round((v - threads0.get(k, 0.0)) / ok * 1e6) for k, v in threads1.items()}
    stats = re.findall(r"nicoffload\.serve: fronts: (\{.*\})", log.read_text())
    fronts_stats = json.loads(stats[-1]) if stats else {}
    return {
        "tree": str(tree),
        "event_loop": loop or "default",
        # what ran, as the fronts said (a tree from before they said it: asyncio's)
        "fronts_event_loop": fronts_stats.get("event_loop", "asyncio (not said)"),
        "load_event_loop": load_loop or front_loop or "asyncio",
        "ready_event_loop": s.doc.get("event_loop"),  # serve's line, where it says one
        "ok": r["ok"],
        "goodput_per_s": r["goodput_per_s"],
        "p50_ms": r["latency_ms"]["p50"],
        "p99_ms": r["latency_ms"]["p99"],
        "serve_us_per_request": round((cpu1 - cpu0) / ok * 1e6),
        # serve's process less the kernels on its host workers: what serving costs it
        "overhead_us_per_request": sum(v for k, v in by.items() if not k.startswith(WORKERS)),
        "by_thread_us": {k: v for k, v in by.items() if v},
        "fronts_us_per_request": round((fronts1 - fronts0) / ok * 1e6),
        "load_us_per_request": round(r["client_cpu_ms_per_request"] * 1e3),
        "fronts_stats": fronts_stats or None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, action="append", help="a checkout (default: this)")
    ap.add_argument("--loops", default=None, help="event loops to interleave, e.g. asyncio,uvloop")
    ap.add_argument("--fronts", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="open loop instead (requests/s)")
    ap.add_argument("--procs", type=int, default=2, help="load processes")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="96x128", help="HxW of the JPEGs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    loops: list[str | None] = list(args.loops.split(",")) if args.loops else [None]
    for name in (n for spec in loops if spec for n in spec.split("/")):
        eventloop.chosen(name)  # a wrong name or a missing uvloop is said before any run
    h, w = (int(x) for x in args.size.split("x"))
    images = typical_jpegs(8, h, w)
    pipeline = nicoffload.load_pipeline(PIPELINE)
    doc: dict[str, Any] = {"command": " ".join(sys.argv), "load_before": loadavg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plan = plan_placement(pipeline, {n.name: "cpu" for n in pipeline.nodes}, local_topology())
        plan.save(folder / "host.json")
        (folder / "logs").mkdir()
        for _ in range(args.rounds):
            for tree in trees:
                for loop in loops:
                    run = one(tree, loop, folder / "host.json", images, args, folder / "logs")
                    doc["runs"].append(run)
                    print(json.dumps(run), file=sys.stderr, flush=True)
    doc["load_after"] = loadavg()
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    for tree in trees:
        for loop in loops:
            runs = [
                r
                for r in doc["runs"]
                if r["tree"] == str(tree) and r["event_loop"] == (loop or "default")
            ]
            over = [r["overhead_us_per_request"] for r in runs]
            fronts = [r["fronts_us_per_request"] for r in runs]
            load_ = [r["load_us_per_request"] for r in runs]
            print(
                f"{tree} fronts on {runs[0]['fronts_event_loop']}: serve's overhead {over} us/request, fronts "
                f"{fronts}, load processes {load_}"
            )


if __name__ == "__main__":
    main()
