"""The fleet simulator against the real pipeline on this machine: for each policy, an open Session
on the local topology (the host CPU plus an emulated DPU: a local agent on its own cores) is fed
Poisson arrivals at a few rates, and the simulator (`nicoffload.fleet`) is run for the same
topology, plan and rates; throughput, host CPU per item and p99 side by side, with the error.

    python bench/bench_simulate.py [--policies all-host,planner,planner+assist]
                                   [--loads 0.3,0.6,0.9,1.3]
                                   [--duration 8] [--out FILE.json]

Loads are fractions of the planner's predicted throughput of each policy's plan. A request's
latency runs from when it was due to when its batch came out of `Session.stream`; host CPU is
this process's CPU time per item (the agent's is the DPU's). The first second is warm-up. The
machine is shared: the share of a core a busy thread got just before and after each run is
measured (`cpu_share`), and the simulator is run twice, with the profiled capacities and with
the CPU devices' capacity times that share (`simulated_at_cpu_share`).
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

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_prediction import typical_jpegs

import nicoffload
from nicoffload.fleet.model import plan_of, stream_model
from nicoffload.fleet.sim import Offered, simulate_server
from nicoffload.graph import with_typical
from nicoffload.procstat import agent_cpu_s
from nicoffload.sizes import typical_of
from nicoffload.topology import local_topology

WARMUP_S = 1.0


def poisson(rate: float, duration: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process: what the run offers and the simulator replays."""
    rng = np.random.default_rng(seed)
    due = np.cumsum(rng.exponential(1.0 / rate, int(rate * duration * 1.2) + 10))
    return due[due < duration]


def measure(session, images: list[bytes], due: np.ndarray, duration: float) -> dict:
    """Open loop: each item is offered when it is due."""
    rate = len(due) / duration
    t0 = time.perf_counter()

    def items():
        for i, t in enumerate(due):
            wait = t0 + t - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            yield images[i % len(images)]

    done = np.empty(len(due))
    at = 0
    cpu_w = agent_w = None
    batches = 0
    for batch in session.stream(items()):
        batches += 1
        now = time.perf_counter() - t0
        done[at : at + len(batch)] = now
        at += len(batch)
        if cpu_w is None and now >= WARMUP_S:
            cpu_w, agent_w, n_w, t_w = time.process_time(), agent_cpu_s(), at, now
    wall = time.perf_counter() - t0
    cpu1, agent1 = time.process_time(), agent_cpu_s()
    counted = at - n_w
    window = (due >= WARMUP_S)[:at]
    lat = (done[:at] - due[:at])[window] * 1e3
    return {
        "offered_per_s": round(rate, 1),
        "throughput_per_s": round(counted / (wall - t_w), 1),
        "host_cpu_ms_per_item": round((cpu1 - cpu_w) * 1e3 / counted, 4),
        "agent_cpu_ms_per_item": round((agent1 - agent_w) * 1e3 / counted, 4),
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "items": int(at),
        "mean_batch": round(at / max(1, batches), 2),
        "wall_s": round(wall, 2),
    }


def cpu_share(seconds: float = 0.5) -> float:
    """The share of one core a busy thread of this process gets now: 1 on an idle machine,
    less when other work takes the cores (this machine is shared)."""
    c0, w0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        pass
    return min(1.0, (time.process_time() - c0) / (time.perf_counter() - w0))


def simulated(model, due: np.ndarray, duration: float, share: float = 1.0) -> dict:
    """The simulator on the same arrivals; `share` < 1 gives each CPU device (the host and the
    emulated DPU, both this machine's cores) that share of its capacity."""
    rate = len(due) / duration
    offered = [Offered(model, rate, due * 1e3)]
    capacity = {k: c * share if k in ("cpu", "dpu0") else c for k, c in model.capacity.items()}
    (run,) = simulate_server(capacity, model.host, offered, duration, warmup_s=WARMUP_S)
    done = run.goodput_per_s * run.window_s
    return {
        "offered_per_s": round(rate, 1),
        "throughput_per_s": round(run.goodput_per_s, 1),
        "host_cpu_ms_per_item": round(run.host_cpu_ms / done, 4) if done else None,
        "p50_ms": round(float(np.percentile(run.latencies_ms, 50)), 3),
        "p99_ms": round(float(np.percentile(run.latencies_ms, 99)), 3),
        "mean_batch": round(len(due) / max(1, run.batches), 2),
    }


def error(sim: float | None, real: float) -> float | None:
    return None if sim is None or not real else round((sim - real) / real, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="all-host,planner,planner+assist")
    ap.add_argument("--loads", default="0.3,0.6,0.9,1.3")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--pipeline", default="pipelines/resnet50.yaml")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    images = typical_jpegs(64, 375, 500)
    base = nicoffload.load_pipeline(args.pipeline)
    pipeline = with_typical(base, typical_of(base, (("", {"image": b}) for b in images)))
    topology = local_topology()
    load0 = os.getloadavg()
    rows = []
    for policy in args.policies.split(","):
        model = stream_model(pipeline, topology, (), policy)
        plan = plan_of(pipeline, topology, (), policy)
        cap = model.predicted.throughput_per_s
        with nicoffload.open(pipeline, plan, topology) as s:
            s.run(images[:16])  # warm: kernels compiled, the agent's stage loaded
            for i, frac in enumerate(float(x) for x in args.loads.split(",")):
                rate = frac * cap
                due = poisson(rate, args.duration, seed=i)
                before = cpu_share()
                real = measure(s, images, due, args.duration)
                share = (before + cpu_share()) / 2  # the share the run had, about
                real["cpu_share"] = round(share, 3)
                sim = simulated(model, due, args.duration)
                at_share = simulated(model, due, args.duration, share)
                keys = ("throughput_per_s", "host_cpu_ms_per_item", "p99_ms")
                row = {
                    "policy": policy,
                    "placement": model.placement,
                    "load": frac,
                    "measured": real,
                    "simulated": sim,
                    "error": {k: error(sim[k], real[k]) for k in keys},
                    "simulated_at_cpu_share": at_share,
                    "error_at_cpu_share": {k: error(at_share[k], real[k]) for k in keys},
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    doc = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
