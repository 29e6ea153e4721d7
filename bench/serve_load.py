"""bench_serve's pieces that drive one server: a `nicoffload serve` process (`Serve`: its ready
line, its CPU, its fronts apart from its agents), where a protocol's requests go (`Target`),
and one run of load against it (`load`: in this process or spread over load processes)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nicoffload.procstat import child_pids, process_cpu_s, tree_cpu_s
from nicoffload.serve import loadgen as lg
from nicoffload.serve.threads import cpu_by_thread

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"
NICOFFLOAD = [sys.executable, "-m", "nicoffload"]  # also where no console script is installed
# kept up: every request answered 200, the last within 5% of the run's length after its end
KEPT_UP = 0.95


class Serve:
    """A `nicoffload serve --plan PLAN` process and its ready line."""

    def __init__(
        self, plan: Path, log: Path, grpc: bool = False, more: tuple = (), tree: Path = ROOT
    ) -> None:
        """`tree`: the source tree serve runs from (its package and pipeline): another
        checkout's, for a before/after comparison on one machine."""
        more = [*(["--grpc", "127.0.0.1:0"] if grpc else []), *more]
        self.proc = subprocess.Popen(
            [
                *NICOFFLOAD,
                "serve",
                str(tree / PIPELINE.relative_to(ROOT)),
                "--plan",
                str(plan),
                "--listen",
                "127.0.0.1:0",
                *more,
            ],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            cwd=tree,  # `python -m` imports the package from here
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise SystemExit(f"serve did not become ready: {log.read_text()[-2000:]}")
        self.doc = json.loads(line)
        # --fronts: its front processes, apart from its agents (and from multiprocessing's
        # resource tracker, which the fronts' shared memory starts)
        self.fronts = list(self.doc.get("front_pids") or [])
        self.agents = [
            c
            for c in child_pids(self.proc.pid)
            if c not in self.fronts and b"resource_tracker" not in _cmdline(c)
        ]

    def cpu(self) -> tuple[float, float]:
        """(serve's CPU s, its agents' CPU s)."""
        return process_cpu_s(self.proc.pid), sum(
            tree_cpu_s(a) for a in self.agents
        )  # their worker processes too

    def fronts_cpu(self) -> float:
        """Its front processes' CPU s (--fronts)."""
        return sum(self.fronts_cpu_each())

    def fronts_cpu_each(self) -> list[float]:
        """Each front process's CPU s: how evenly the shared listener spreads the load."""
        return [process_cpu_s(f) for f in self.fronts]

    def threads(self) -> dict[str, float]:
        """serve's CPU s by thread name (serve names its threads: event loop, batcher,
        the runtime's workers, reader and feeder)."""
        return cpu_by_thread(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


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


@dataclasses.dataclass
class Target:
    """Where a protocol's requests go, the bodies it sends, and the client processes (None:
    this one)."""

    url: str
    bodies: list
    pool: Any = None  # a loadgen.pool of `clients` processes
    clients: int = 1


def load(t: Target, seconds: float, rate: float | None = None, conc: int = 1) -> dict:
    if t.pool is None:
        cpu = time.process_time()
        results, wall = asyncio.run(
            lg.run_load(t.url, t.bodies, seconds, rate, None if rate is not None else conc)
        )
        client_cpu, n = time.process_time() - cpu, 1
    else:  # N Poisson streams of rate/N make one of the rate; closed loop: the clients dealt out
        results, wall, client_cpu, n = lg.run_procs(
            t.pool, t.clients, t.url, t.bodies, seconds, rate, None if rate is not None else conc
        )
    doc = lg.summarize(results, wall, rate)
    doc |= breakdown(results, doc)
    doc["client_cpu_ms_per_request"] = round(client_cpu / max(1, doc["ok"]) * 1e3, 3)
    doc["client_processes"] = n
    if rate is None:
        doc["concurrency"] = conc
    return doc
