"""Serving latency under load: `nicoffload serve` (a real process) loaded with loadgen's code,
over HTTP and/or gRPC (`--protocol`), for the host-only plan, the planner's plan of this
machine's local topology (host + the emulated DPU agent, gpu0 where CUDA works), all-GPU, and a
DPU stage per transport between the agent and the host (`--transport`).

Per plan and protocol: the unloaded p50 (closed loop, one request at a time); closed loop at
rising concurrency (its best goodput); an open-loop (Poisson) sweep at rising shares of that
best (up to 1.5x it): the saturation rate is the highest the server keeps up with (every
request answered 200, the last answer within 5% of the run's length after its end); then open
loop at 50% and 80% of the saturation rate: p50/p99, and whether the per-request breakdown the
server returns (receive + queue + pipeline [+ model]) sums to the end-to-end latency the client
measured (their ratio of means; `server_ratio` is the server's own `server_us` against it).
CPU seconds of the serve process (by thread too), of its agent and of the load generator per
answered request over the 50% and 80% runs. One item (an ImageNet-size JPEG, bench_prediction.typical_jpegs) per request; the client
runs on the same machine, so it competes with the server for the cores; `--clients N` spreads
it over N processes (open loop: N Poisson streams of rate/N; closed loop: the clients split
among them), so that one Python client is not the cap.

    python bench/bench_serve.py [--unloaded-s 5] [--step-s 4] [--open-s 10] [--failover-s 60]
                                [--protocol http|grpc|both] [--plans host,planner,gpu]
                                [--transport tcp,shm,rdma] [--clients N] [--concurrency 2,4,8,16]
                                [--fronts 1,4,8 --loadgen-procs 4,6 --rates 2000,4000,..]
                                [--json] [--out DIR]

`--fronts F,..` (issue #19's H200 target; serve_fronts.py): instead of the curves, per plan the
Session's own stream throughput, then `serve --fronts F` for each F, loaded open loop at
`--rates` from each `--loadgen-procs` count (loadgen.run_procs: P Poisson streams of R/P,
every latency merged), each sweep stopping at the first rate not kept up: goodput, p50/p99,
host CPU per request (serve's process, its fronts, its agents), and the best goodput with
p99 <= 20 ms over the Session's throughput (0.8 wanted).

`--plans`: `host` (every node on the host CPU), `planner` (plan_for the local topology), `gpu`
(every node on gpu0; skipped, with the reason, without CUDA). `--transport T,...`: for each T, a
plan with decode on the agent (dpu0) and the rest on gpu0 (the host CPU without one), its DPU
stage's physical scheme (the plan's `physical[stage].scheme`, what the runtime moves the
stage's outputs over) set to T; rdma is skipped, with the reason, where no verbs device exists.

With `--failover-s S`, a plan with an agent then runs open loop (HTTP) at 80% of its saturation
rate for S seconds with one SIGKILL of its agent a third of the way in: every request must be
answered 200 (nothing lost) with its own image's tensor, equal to the all-host run's (nothing
doubled or crossed).

`--out DIR` writes bench_serve.json and, per plan and protocol, the loadgen plots (PNG) of the
closed-loop runs and of the open-loop ones (the sweep's and the 50% and 80% runs, by offered
load), the plan and serve's log.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_fronts
from bench_prediction import loadavg, typical_jpegs
from serve_load import KEPT_UP, PIPELINE, Serve, Target, load

import nicoffload
from nicoffload.planner import physical, plan_for, plan_placement
from nicoffload.planner.plan import Plan
from nicoffload.serve import loadgen as lg
from nicoffload.serve.kserve import HEADER_LENGTH
from nicoffload.topology import local_topology

CONCURRENCY = "2,4,8,16"
# shares of the closed loop's best goodput; past 1.0 because the closed loop's best is bounded
# by its clients (C over the latency), not only by the server
SWEEP = (0.3, 0.45, 0.6, 0.75, 0.9, 1.0, 1.2, 1.5)
PROTOCOLS = ("http", "grpc")
TRANSPORTS = physical.SCHEMES  # tcp, shm, rdma


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


def curve(t: Target, s: Serve, args: argparse.Namespace) -> dict[str, Any]:
    """One protocol's runs against a started server: unloaded, closed loop, the open-loop
    sweep to saturation, 50% and 80% of it (with the CPU per request over those two)."""
    load(t, 1.0)  # warm-up (numba caches, the agent's first batches, the connections)
    unloaded = load(t, args.unloaded_s)
    closed = [unloaded]
    for c in args.concurrency:
        print(f"  closed loop, {c} clients ...", file=sys.stderr, flush=True)
        closed.append(load(t, args.step_s, conc=c))
    closed_best = max(r["goodput_per_s"] for r in closed)
    # open loop at rising rates up to the closed loop's best: the highest rate the server
    # keeps up with is the saturation rate
    sweep, saturation = [], 0.0
    for share in SWEEP:
        rate = round(closed_best * share, 1)
        print(f"  open-loop sweep, {rate}/s ...", file=sys.stderr, flush=True)
        r = load(t, args.step_s, rate=rate)
        sweep.append(r)
        # kept up: every request answered 200, the last within 5% of the run's length
        # after its end (goodput over offered would judge Poisson's count, not the server)
        if r["errors_by_status"] or r["duration_s"] > args.step_s / KEPT_UP:
            break
        saturation = rate
    opened = []
    cpu0, threads0 = s.cpu(), s.threads()
    for share in (0.5, 0.8) if saturation else ():  # none kept up: nothing to load at
        rate = round(saturation * share, 1)
        print(f"  open loop, {rate}/s ...", file=sys.stderr, flush=True)
        opened.append(load(t, args.open_s, rate=rate) | {"share": share})
    cpu1, threads1 = s.cpu(), s.threads()
    answered = sum(r["ok"] for r in opened) or 1
    by_thread = {
        k: round((v - threads0.get(k, 0.0)) / answered * 1e3, 3)
        for k, v in sorted(threads1.items(), key=lambda kv: threads0.get(kv[0], 0.0) - kv[1])
    }
    p50 = unloaded["latency_ms"]["p50"]
    at50, at80 = (r["latency_ms"]["p99"] for r in opened) if opened else (None, None)
    # the highest rate answered with p99 <= 20 ms (issue #19's H200 target)
    within = [
        r["goodput_per_s"]
        for r in sweep + opened
        if not r["errors_by_status"] and (r["latency_ms"]["p99"] or 1e9) <= 20.0
    ]
    return {
        "unloaded_p50_ms": p50,
        "unloaded_p99_ms": unloaded["latency_ms"]["p99"],
        "saturation_per_s": saturation,
        "closed_loop_best_per_s": closed_best,
        "closed_loop_best_concurrency": max(closed, key=lambda r: r["goodput_per_s"])[
            "concurrency"
        ],
        "p50_at_50pct_ms": opened[0]["latency_ms"]["p50"] if opened else None,
        "p99_at_50pct_ms": at50,
        "p99_at_80pct_ms": at80,
        "p99_at_50pct_over_unloaded_p50": None if not p50 or at50 is None else round(at50 / p50, 2),
        "best_goodput_p99_within_20ms_per_s": max(within, default=None),
        # what the slowest 1% at 50% spent their time on (ms, mean per request)
        "tail_at_50pct_ms": opened[0].get("tail_breakdown_ms") if opened else None,
        "serve_cpu_ms_per_request": round((cpu1[0] - cpu0[0]) / answered * 1e3, 3),
        "agent_cpu_ms_per_request": round((cpu1[1] - cpu0[1]) / answered * 1e3, 3),
        # where serve's CPU went, by thread (MainThread: the event loop, HTTP or gRPC;
        # nicoffload-serv: the batcher; nicoffload-work: the runtime's workers)
        "serve_cpu_ms_per_request_by_thread": {k: v for k, v in by_thread.items() if v},
        "client_cpu_ms_per_request": round(
            sum(r["client_cpu_ms_per_request"] * r["ok"] for r in opened) / answered, 3
        ),
        "closed": closed,
        "sweep": sweep,
        "open": opened,
    }


def targets(s: Serve, images: list[bytes], protocols: list[str], pool: Any, n: int) -> dict:
    out = {}
    for proto in protocols:
        if proto == "http":
            out[proto] = Target(s.doc["url"], [lg.request_body("image", [b]) for b in images])
        else:
            bodies = [lg.grpc_request_body(s.doc["model"], "image", [b]) for b in images]
            out[proto] = Target(f"{lg.GRPC}{s.doc['grpc']}", bodies)
        out[proto].pool, out[proto].clients = pool, n
    return out


def measure(
    plan: Plan,
    images: list[bytes],
    want: list[bytes],
    args: argparse.Namespace,
    folder: Path,
    slug: str,
    pool: Any,
) -> dict:
    load_before = loadavg()
    plan.save(folder / f"{slug}.json")
    s = Serve(folder / f"{slug}.json", folder / f"{slug}.log", grpc="grpc" in args.protocols)
    by_protocol = {}
    try:
        ts = targets(s, images, args.protocols, pool, args.clients)
        for proto, t in ts.items():
            print(f" {proto} ...", file=sys.stderr, flush=True)
            by_protocol[proto] = curve(t, s, args)
        failover_run = None
        saturation = next(iter(by_protocol.values()))["saturation_per_s"]
        if args.failover_s and s.agents and saturation:
            rate = round(saturation * 0.8, 1)
            print(
                f"  failover (HTTP): {rate}/s for {args.failover_s:g} s ...",
                file=sys.stderr,
                flush=True,
            )
            bodies = [lg.request_body("image", [b]) for b in images]
            failover_run = asyncio.run(
                _failover_load(s.doc["url"], bodies, want, rate, args.failover_s, s.agents)
            )
    finally:
        code = s.stop()
    log = (folder / f"{slug}.log").read_text()
    failovers = [line for line in log.splitlines() if "failover" in line]
    return {
        "placement": s.doc["placement"],
        # the DPU stages' transport schemes: the plan's physical decisions, and serve's
        "schemes": {k: v.get("scheme") for k, v in plan.physical.items()},
        "serve_transports": s.doc.get("transports"),
        # serve's policies in force (absent from a serve older than them)
        "serve_policy": {
            k: s.doc.get(k) for k in ("max_batch", "close_when_idle", "switch_interval_us")
        },
        "stages": s.doc["stages"],
        "predicted": s.doc["predicted"],
        "load_before": load_before,
        "serve_exit": code,
        "failover": failovers,  # serve's log lines: the runtime took the DPU stages back
        "failover_run": failover_run,  # --failover-s: the agents killed under open-loop load
        "by_protocol": by_protocol,
    }


def with_scheme(plan: Plan, pipeline: Any, topology: Any, scheme: str) -> Plan:
    """The plan with every DPU stage's outputs moved over `scheme` (its physical decisions
    completed as the runtime would, then the scheme written)."""
    done = physical.complete(pipeline, plan, topology)
    decided = {k: {**v, "scheme": scheme} for k, v in done.physical.items()}
    return dataclasses.replace(done, physical=decided)


def rdma_missing() -> str | None:
    """Why the rdma transport cannot run here (no pyverbs, no verbs device), or None."""
    from nicoffload.transport import verbs

    try:
        found = verbs.devices()
    except Exception as exc:  # DeviceError: pyverbs is not installed
        return str(exc)
    return None if found else "no RDMA device (ibv_get_device_list found none)"


def choose_plans(
    pipeline: Any, topology: Any, args: argparse.Namespace
) -> tuple[dict[str, Plan], dict[str, str]]:
    """The plans `--plans` and `--transport` name, and those skipped with the reason."""
    nodes = [n.name for n in pipeline.nodes]
    gpu = "gpu0" in topology.ids
    plans: dict[str, Plan] = {}
    skipped: dict[str, str] = {}
    for name in args.plans:
        if name == "host":
            plans["host only"] = plan_placement(pipeline, dict.fromkeys(nodes, "cpu"), topology)
        elif name == "planner":
            plans["planner"] = plan_for(pipeline, topology)
        elif name == "gpu":
            if gpu:
                plans["all gpu"] = plan_placement(pipeline, dict.fromkeys(nodes, "gpu0"), topology)
            else:
                skipped["all gpu"] = "no gpu0 in the local topology (CUDA does not work here)"
    for scheme in args.transports:
        name = f"dpu decode over {scheme}"
        if "dpu0" not in topology.ids:
            skipped[name] = "no emulated dpu0 in the local topology (one core)"
            continue
        if scheme == "rdma" and (why := rdma_missing()) is not None:
            skipped[name] = why
            continue
        rest = "gpu0" if gpu else "cpu"
        placement = {n: ("dpu0" if n == "decode" else rest) for n in nodes}
        plans[name] = with_scheme(
            plan_placement(pipeline, placement, topology), pipeline, topology, scheme
        )
    return plans, skipped


def fronts_row(
    pipeline: Any,
    plan: Plan,
    topology: Any,
    images: list[bytes],
    args: argparse.Namespace,
    folder: Path,
    slug: str,
) -> dict[str, Any]:
    """--fronts: the Session's stream throughput, then serve's sweeps per front count."""
    print(" the Session's stream ...", file=sys.stderr, flush=True)
    session = serve_fronts.session_throughput(pipeline, plan, topology, images)
    by_fronts = serve_fronts.measure(plan, images, args, folder, f"serve-{slug}")
    return {
        "placement": dict(plan.placement),
        "session": session,
        "by_fronts": by_fronts,
        "ratio": serve_fronts.ratios(by_fronts, session),
    }


def words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unloaded-s", type=float, default=5.0, help="one request at a time")
    ap.add_argument("--step-s", type=float, default=4.0, help="each closed-loop concurrency")
    ap.add_argument("--open-s", type=float, default=10.0, help="each open-loop rate")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument(
        "--protocol",
        choices=("http", "grpc", "both"),
        default="http",
        help="what the load generator speaks (both: each plan over HTTP, then over gRPC)",
    )
    ap.add_argument(
        "--plans",
        default="host,planner",
        help="comma list of host, planner, gpu (every node on gpu0), or none",
    )
    ap.add_argument(
        "--transport",
        default="",
        help="comma list of tcp, shm, rdma: for each, a plan with decode on the agent whose "
        "outputs move to the host over it (the plan's physical scheme); rdma skipped where no "
        "verbs device exists",
    )
    ap.add_argument(
        "--clients", type=int, default=1, help="load generator processes (1: this process)"
    )
    ap.add_argument(
        "--concurrency",
        default=CONCURRENCY,
        help="the closed loop's client counts, a comma list (after one request at a time)",
    )
    ap.add_argument(
        "--failover-s",
        type=float,
        default=0.0,
        help="then, for a plan with an agent: open loop at 80%% of saturation for this long, the "
        "agent killed (SIGKILL) a third of the way in; every answer's tensor checked (0: off)",
    )
    ap.add_argument(
        "--fronts",
        default="",
        help="comma list of front process counts (serve --fronts F): instead of the curves "
        "above, for each plan and F an open-loop sweep at --rates from each --loadgen-procs "
        "count, beside the Session's own stream throughput (serve_fronts.py)",
    )
    ap.add_argument(
        "--loadgen-procs", default="4", help="with --fronts: comma list of load process counts"
    )
    ap.add_argument(
        "--rates",
        default="1000,2000,4000,6000,8000,10000,12000,14000,16000",
        help="with --fronts: the open-loop rates (requests/s), in order; a sweep stops at the "
        "first one not kept up",
    )
    ap.add_argument(
        "--max-queue", type=int, default=4096, help="with --fronts: serve's --max-queue"
    )
    ap.add_argument(
        "--front-slots", type=int, default=24, help="with --fronts: serve's --front-slots"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--out", type=Path, help="write bench_serve.json and the plots here")
    args = ap.parse_args()
    args.protocols = list(PROTOCOLS) if args.protocol == "both" else [args.protocol]
    args.plans = [p for p in words(args.plans) if p != "none"]
    args.transports = words(args.transport)
    for bad in [p for p in args.plans if p not in ("host", "planner", "gpu")]:
        ap.error(f"--plans: unknown plan {bad!r} (host, planner, gpu)")
    for bad in [t for t in args.transports if t not in TRANSPORTS]:
        ap.error(f"--transport: unknown transport {bad!r} ({', '.join(TRANSPORTS)})")
    if args.clients < 1:
        ap.error("--clients: at least 1")
    try:
        args.concurrency = [int(c) for c in words(args.concurrency)]
    except ValueError:
        args.concurrency = []
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: a comma list of client counts >= 1 (2,4,8,16)")
    try:
        args.fronts = [int(f) for f in words(args.fronts)]
        args.loadgen_procs = [int(p) for p in words(args.loadgen_procs)]
        args.rates = [float(r) for r in words(args.rates)]
    except ValueError as exc:
        ap.error(f"--fronts, --loadgen-procs, --rates: comma lists of numbers ({exc})")
    if args.fronts and (
        min(args.fronts) < 1 or not args.loadgen_procs or min(args.loadgen_procs) < 1
    ):
        ap.error("--fronts and --loadgen-procs: counts >= 1")
    if args.fronts and (not args.rates or min(args.rates) <= 0):
        ap.error("--rates: requests/s > 0")
    pipeline = nicoffload.load_pipeline(PIPELINE)
    topology = local_topology()
    hints = dict(pipeline.inputs["image"].hints)
    images = typical_jpegs(args.images, hints.get("height", 375), hints.get("width", 500))
    host = plan_placement(pipeline, {n.name: "cpu" for n in pipeline.nodes}, topology)
    pixels = nicoffload.run(pipeline, images, plan=host).outputs["pixels"]
    want = [pixels[i : i + 1].tobytes() for i in range(len(images))]
    plans, skipped = choose_plans(pipeline, topology, args)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or '?'})",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "load_before": loadavg(),
        "client_processes": args.clients,
        "skipped": skipped,
        "plans": {},
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    pool = lg.pool(args.clients) if args.clients > 1 else None  # spawned, not forked
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, plan in plans.items():
                print(f"{name} ...", file=sys.stderr, flush=True)
                slug = name.replace(" ", "-")
                if args.fronts:
                    doc["plans"][name] = fronts_row(
                        pipeline, plan, topology, images, args, args.out or Path(tmp), slug
                    )
                    continue
                row = measure(
                    plan, images, want, args, args.out or Path(tmp), f"serve-{slug}", pool
                )
                doc["plans"][name] = row
                for proto, r in row["by_protocol"].items() if args.out else ():
                    tag = f"serve-{slug}-{proto}"
                    lg.plot(r["closed"], str(args.out / f"{tag}-closed.png"))
                    opened = sorted(r["sweep"] + r["open"], key=lambda x: x["offered_per_s"])
                    lg.plot(opened, str(args.out / f"{tag}-open.png"))
    finally:
        if pool is not None:
            pool.shutdown()
    doc["load_after"] = loadavg()
    if args.out:
        (args.out / "bench_serve.json").write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    if args.fronts:
        print(f"{doc['machine']}, {doc['date']}, load {doc['load_before']} -> {doc['load_after']}")
        print("\n".join(serve_fronts.table(doc)))
        return 0
    print(f"{doc['machine']}, {doc['date']}, load {doc['load_before']} -> {doc['load_after']}")
    print(f"client processes: {args.clients}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    cols = (
        ("plan", "<22", None),
        ("proto", "<5", None),
        ("p50 1-at-a-time", ">15", "unloaded_p50_ms"),
        ("saturation/s", ">12", "saturation_per_s"),
        ("p99<=20ms /s", ">12", "best_goodput_p99_within_20ms_per_s"),
        ("p99@50%", ">8", "p99_at_50pct_ms"),
        ("p99@80%", ">8", "p99_at_80pct_ms"),
        ("x p50", ">6", "p99_at_50pct_over_unloaded_p50"),
        ("ratio@50%", ">9", 0),
        ("ratio@80%", ">9", 1),
        ("serve ms/req", ">12", "serve_cpu_ms_per_request"),
        ("agent ms/req", ">12", "agent_cpu_ms_per_request"),
        ("client ms/req", ">13", "client_cpu_ms_per_request"),
    )
    print(" ".join(format(c[0], c[1]) for c in cols))
    for name, row in doc["plans"].items():
        for proto, r in row["by_protocol"].items():
            ratios = [o["ratio"] for o in r["open"]] + [None, None]
            cells = [format(name, "<22"), format(proto, "<5")]
            for _, spec, key in cols[2:]:
                x = ratios[key] if isinstance(key, int) else r[key]
                num = spec + (".3f" if _.endswith("ms/req") or _.startswith("ratio") else ".1f")
                cells.append(format("-", spec) if x is None else format(x, num))
            print(" ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
