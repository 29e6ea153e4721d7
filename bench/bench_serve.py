"""Serving latency under load: `nicoffload serve` (a real process) loaded with loadgen's code,
for the host-only plan and the planner's plan of this machine's local topology (host + the
emulated DPU agent).

Per plan: the unloaded p50 (closed loop, one request at a time); closed loop at rising
concurrency (its best goodput); an open-loop (Poisson) sweep at rising shares of that best: the
saturation rate is the highest the server keeps up with (every request answered 200, the last
answer within 5% of the run's length after its end); then open loop at 50% and 80% of the
saturation rate: p50/p99, and whether the per-request breakdown the server returns (receive +
queue + pipeline [+ model]) sums to the end-to-end latency the client measured (their ratio of
means; `server_ratio` is the server's own `server_us` against it). CPU seconds of the serve
process and of its agent per answered request over the 50% and 80% runs. One item (an
ImageNet-size JPEG, bench_prediction.typical_jpegs) per request; the client (this process) runs
on the same machine, so it competes with the server for the cores.

    python bench/bench_serve.py [--unloaded-s 5] [--step-s 4] [--open-s 10] [--failover-s 60]
                                [--json] [--out DIR]

With `--failover-s S`, a plan with an agent then runs open loop at 80% of its saturation rate for
S seconds with one SIGKILL of its agent a third of the way in: every request must be answered
200 (nothing lost) with its own image's tensor, equal to the all-host run's (nothing doubled or
crossed).

`--out DIR` writes bench_serve.json and, per plan, the loadgen plots (PNG) of the closed-loop
runs and of the open-loop ones (the sweep's and the 50% and 80% runs, by offered load), the
plan and serve's log.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prediction import loadavg, typical_jpegs

import nicoffload
from nicoffload.planner import plan_for, plan_placement
from nicoffload.planner.plan import Plan
from nicoffload.procstat import child_pids, process_cpu_s, tree_cpu_s
from nicoffload.serve import loadgen as lg
from nicoffload.serve.kserve import HEADER_LENGTH
from nicoffload.topology import local_topology

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"
NICOFFLOAD = [sys.executable, "-m", "nicoffload"]  # also where no console script is installed
CONCURRENCY = (2, 4, 8, 16)
SWEEP = (0.3, 0.45, 0.6, 0.75, 0.9, 1.0)  # shares of the closed loop's best goodput
KEPT_UP = 0.95


class Serve:
    """A `nicoffload serve --plan PLAN` process and its ready line."""

    def __init__(self, plan: Path, log: Path) -> None:
        self.proc = subprocess.Popen(
            [*NICOFFLOAD, "serve", str(PIPELINE), "--plan", str(plan), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            cwd=ROOT,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise SystemExit(f"serve did not become ready: {log.read_text()[-2000:]}")
        self.doc = json.loads(line)
        self.agents = child_pids(self.proc.pid)

    def cpu(self) -> tuple[float, float]:
        """(serve's CPU s, its agents' CPU s)."""
        return process_cpu_s(self.proc.pid), sum(
            tree_cpu_s(a) for a in self.agents
        )  # their worker processes too

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def breakdown(results: list[lg.Result], doc: dict[str, Any]) -> dict[str, Any]:
    """Whether the per-request parts sum to the client's end-to-end latency (ratio of means:
    loadgen's `attributed_ratio`), and the server's own `server_us` against it."""
    ok = [r for r in results if r.status == 200]
    if not ok:
        return {"ratio": None, "server_ratio": None}
    latency = sum(r.latency_s for r in ok) * 1e6
    server = sum(r.timings.get("server_us", 0) for r in ok)
    return {
        "latency_mean_ms": round(latency / len(ok) / 1e3, 3),
        "ratio": doc.get("attributed_ratio"),
        "server_ratio": round(server / latency, 3),
    }


def load(url: str, bodies: list, seconds: float, rate: float | None = None, conc: int = 1) -> dict:
    results, wall = asyncio.run(
        lg.run_load(url, bodies, seconds, rate, None if rate is not None else conc)
    )
    doc = lg.summarize(results, wall, rate)
    doc |= breakdown(results, doc)
    if rate is None:
        doc["concurrency"] = conc
    return doc


async def _failover_load(
    url: str, bodies: list, want: list[bytes], rate: float, seconds: float, agents: list[int]
) -> dict[str, Any]:
    """Open loop at `rate` for `seconds`, the agents killed (SIGKILL) a third of the way in;
    each answer's tensor compared with its image's, from the all-host run."""
    import aiohttp

    async def one(session: Any, i: int) -> tuple[int, bool]:
        body, headers = bodies[i % len(bodies)]
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return resp.status, False
                return 200, raw[int(resp.headers[HEADER_LENGTH]) :] == want[i % len(want)]
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0, False

    kill_at = seconds / 3
    timeout = aiohttp.ClientTimeout(total=max(60.0, seconds * 2))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0, tasks, killed = time.perf_counter(), [], False
        for i, at in enumerate(lg.arrivals(rate, seconds, seed=1)):
            if (wait := t0 + float(at) - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            if not killed and at >= kill_at:
                for a in agents:
                    os.kill(a, signal.SIGKILL)
                killed = True
            tasks.append(asyncio.ensure_future(one(session, i)))
        out = await asyncio.gather(*tasks)
    by_status = Counter(status for status, _ in out)
    return {
        "offered_per_s": rate,
        "duration_s": seconds,
        "agents_killed_at_s": round(kill_at, 1) if killed else None,
        "sent": len(out),
        "ok": by_status[200],
        "errors_by_status": {str(k): v for k, v in sorted(by_status.items()) if k != 200},
        "wrong_tensor": sum(1 for status, good in out if status == 200 and not good),
    }


def measure(
    plan: Plan, bodies: list, want: list[bytes], args: argparse.Namespace, folder: Path, slug: str
) -> dict:
    load_before = loadavg()
    plan.save(folder / f"{slug}.json")
    s = Serve(folder / f"{slug}.json", folder / f"{slug}.log")
    try:
        url = s.doc["url"]
        load(url, bodies, 1.0)  # warm-up (numba caches, the agent's first batches)
        unloaded = load(url, bodies, args.unloaded_s)
        closed = [unloaded]
        for c in CONCURRENCY:
            print(f"  closed loop, {c} clients ...", file=sys.stderr, flush=True)
            closed.append(load(url, bodies, args.step_s, conc=c))
        closed_best = max(r["goodput_per_s"] for r in closed)
        # open loop at rising rates up to the closed loop's best: the highest rate the server
        # keeps up with is the saturation rate
        sweep, saturation = [], 0.0
        for share in SWEEP:
            rate = round(closed_best * share, 1)
            print(f"  open-loop sweep, {rate}/s ...", file=sys.stderr, flush=True)
            r = load(url, bodies, args.step_s, rate=rate)
            sweep.append(r)
            # kept up: every request answered 200, the last within 5% of the run's length
            # after its end (goodput over offered would judge Poisson's count, not the server)
            if r["errors_by_status"] or r["duration_s"] > args.step_s / KEPT_UP:
                break
            saturation = rate
        opened = []
        cpu0 = s.cpu()
        for share in (0.5, 0.8) if saturation else ():  # none kept up: nothing to load at
            rate = round(saturation * share, 1)
            print(f"  open loop, {rate}/s ...", file=sys.stderr, flush=True)
            opened.append(load(url, bodies, args.open_s, rate=rate) | {"share": share})
        cpu1 = s.cpu()
        failover_run = None
        if args.failover_s and s.agents and saturation:
            rate = round(saturation * 0.8, 1)
            print(
                f"  failover: {rate}/s for {args.failover_s:g} s ...", file=sys.stderr, flush=True
            )
            failover_run = asyncio.run(
                _failover_load(url, bodies, want, rate, args.failover_s, s.agents)
            )
    finally:
        code = s.stop()
    log = (folder / f"{slug}.log").read_text()
    failovers = [line for line in log.splitlines() if "failover" in line]
    answered = sum(r["ok"] for r in opened) or 1
    p50 = unloaded["latency_ms"]["p50"]
    at50, at80 = (r["latency_ms"]["p99"] for r in opened) if opened else (None, None)
    return {
        "placement": s.doc["placement"],
        # serve's policies in force (absent from a serve older than them)
        "serve_policy": {
            k: s.doc.get(k) for k in ("max_batch", "close_when_idle", "switch_interval_us")
        },
        "stages": s.doc["stages"],
        "predicted": s.doc["predicted"],
        "unloaded_p50_ms": p50,
        "load_before": load_before,
        "saturation_per_s": saturation,
        "closed_loop_best_per_s": closed_best,
        "closed_loop_best_concurrency": max(closed, key=lambda r: r["goodput_per_s"])[
            "concurrency"
        ],
        "p99_at_50pct_ms": at50,
        "p99_at_80pct_ms": at80,
        "p99_at_50pct_over_unloaded_p50": None if not p50 or at50 is None else round(at50 / p50, 2),
        # what the slowest 1% at 50% spent their time on (ms, mean per request)
        "tail_at_50pct_ms": opened[0].get("tail_breakdown_ms") if opened else None,
        "serve_cpu_ms_per_request": round((cpu1[0] - cpu0[0]) / answered * 1e3, 3),
        "agent_cpu_ms_per_request": round((cpu1[1] - cpu0[1]) / answered * 1e3, 3),
        "serve_exit": code,
        "failover": failovers,  # serve's log lines: the runtime took the DPU stages back
        "failover_run": failover_run,  # --failover-s: the agents killed under open-loop load
        "closed": closed,
        "sweep": sweep,
        "open": opened,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unloaded-s", type=float, default=5.0, help="one request at a time")
    ap.add_argument("--step-s", type=float, default=4.0, help="each closed-loop concurrency")
    ap.add_argument("--open-s", type=float, default=10.0, help="each open-loop rate")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument(
        "--failover-s",
        type=float,
        default=0.0,
        help="then, for a plan with an agent: open loop at 80%% of saturation for this long, the "
        "agent killed (SIGKILL) a third of the way in; every answer's tensor checked (0: off)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--out", type=Path, help="write bench_serve.json and the plots here")
    args = ap.parse_args()
    pipeline = nicoffload.load_pipeline(PIPELINE)
    topology = local_topology()
    hints = dict(pipeline.inputs["image"].hints)
    images = typical_jpegs(args.images, hints.get("height", 375), hints.get("width", 500))
    bodies = [lg.request_body("image", [b]) for b in images]
    host = plan_placement(pipeline, {n.name: "cpu" for n in pipeline.nodes}, topology)
    pixels = nicoffload.run(pipeline, images, plan=host).outputs["pixels"]
    want = [pixels[i : i + 1].tobytes() for i in range(len(images))]
    plans = {
        "host only": host,
        "planner": plan_for(pipeline, topology),
    }
    doc: dict[str, Any] = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or '?'})",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "load_before": loadavg(),
        "plans": {},
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in plans.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            slug = name.replace(" ", "-")
            row = measure(plan, bodies, want, args, args.out or Path(tmp), f"serve-{slug}")
            doc["plans"][name] = row
            if args.out:
                lg.plot(row["closed"], str(args.out / f"serve-{slug}-closed.png"))
                opened = sorted(row["sweep"] + row["open"], key=lambda r: r["offered_per_s"])
                lg.plot(opened, str(args.out / f"serve-{slug}-open.png"))
    doc["load_after"] = loadavg()
    if args.out:
        (args.out / "bench_serve.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['machine']}, {doc['date']}, load {doc['load_before']} -> {doc['load_after']}")
    print(
        f"{'plan':10} {'p50 1-at-a-time':>15} {'saturation/s':>12} {'p99@50%':>8} {'p99@80%':>8}"
        f" {'x p50':>6} {'ratio@50%':>9} {'ratio@80%':>9} {'serve ms/req':>12} {'agent ms/req':>12}"
    )

    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name, r in doc["plans"].items():
        ratios = [o["ratio"] for o in r["open"]] + [None, None]
        print(
            f"{name:10} {f(r['unloaded_p50_ms'], '15.2f')} {f(r['saturation_per_s'], '12.1f')} "
            f"{f(r['p99_at_50pct_ms'], '8.2f')} {f(r['p99_at_80pct_ms'], '8.2f')} "
            f"{f(r['p99_at_50pct_over_unloaded_p50'], '6.2f')} {f(ratios[0], '9.3f')} "
            f"{f(ratios[1], '9.3f')} {f(r['serve_cpu_ms_per_request'], '12.3f')} "
            f"{f(r['agent_cpu_ms_per_request'], '12.3f')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
