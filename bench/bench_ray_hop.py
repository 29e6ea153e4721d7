"""Why tensors stay on our transports under Ray: one hop of a tensor from an actor on one Ray node
to the driver on another, through Ray's object store against nicoffload's tcp transport (with
its frame MAC, as agents send), side by side in the same run on a local two-node cluster.

    python bench/bench_ray_hop.py [--quick] [--json] [--output bench/RESULTS_ray_hop.md]

Both are pipelined with at most 8 tensors in flight (Ray: calls, each result fetched in turn;
tcp: batches into a ring of 8 slots);
Ray's one-at-a-time hop (one call, one get) is reported beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ray
from bench_transport import machine, size_name

from nicoffload.transport import connect, listen

KiB, MiB = 1 << 10, 1 << 20
BATCH = 64 * 3 * 224 * 224 * 2  # one batch of ResNet-50 inputs: 64 x 3x224x224 float16
SIZES = [150 * KiB, MiB, BATCH]
SLOTS = 8
KEY = bytes(range(32))


@ray.remote(num_cpus=1)
class Sender:
    """On the other node: the tensor, and the two ways of sending it."""

    def __init__(self, size: int) -> None:
        self.array = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)

    def make(self) -> np.ndarray:
        return self.array

    def tcp(self, address: str, n: int) -> None:
        with connect(address, timeout=30, key=KEY) as tx:
            for _ in range(n):
                tx.send([self.array])
            tx.flush()


def ray_hops(sender, n: int) -> tuple[float, float]:
    """Seconds per hop through the object store: pipelined (at most SLOTS in flight, as the
    tcp ring holds), and one at a time."""
    ray.get([sender.make.remote() for _ in range(4)])  # warm
    t0 = time.perf_counter()
    flight: collections.deque = collections.deque()
    for _ in range(n):
        flight.append(sender.make.remote())
        if len(flight) == SLOTS:
            ray.get(flight.popleft())  # fetched into this process, then let go
    ray.get(list(flight))
    pipelined = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(max(4, n // 4)):
        ray.get(sender.make.remote())
    return pipelined, (time.perf_counter() - t0) / max(4, n // 4)


def tcp_hops(sender, size: int, n: int) -> float:
    """Seconds per batch over nicoffload's tcp transport, pipelined, after SLOTS warm ones."""
    host = ray.util.get_node_ip_address()
    with listen(f"tcp://{host}:0", slots=SLOTS, slot_bytes=size, key=KEY) as rx:
        done = sender.tcp.remote(rx.address, n + SLOTS)
        t0 = t1 = 0.0
        for count, delivery in enumerate(rx, 1):  # until the sender closes
            rx.release(delivery)
            if count == SLOTS:
                t0 = time.perf_counter()
            t1 = time.perf_counter()
        elapsed = t1 - t0
        ray.get(done)
    return elapsed / n


def measure(quick: bool, repeats: int) -> list[dict]:
    rows = []
    for size in SIZES:
        n = (20 if quick else 100) if size < BATCH else (5 if quick else 20)
        sender = Sender.options(label_selector={"bench": "far"}).remote(size)
        best: dict[str, float] = {}
        for _ in range(repeats):  # interleaved, best of each
            piped, one = ray_hops(sender, n)
            tcp = tcp_hops(sender, size, n)
            for k, v in (("ray_ms", piped), ("ray_one_ms", one), ("tcp_ms", tcp)):
                best[k] = min(best.get(k, float("inf")), v * 1e3)
        ray.kill(sender)
        rows.append({"size": size_name(size), "bytes": size, "n": n, **best,
                     "ray_over_tcp": best["ray_ms"] / best["tcp_ms"]})  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def report(result: dict) -> str:
    lines = [
        f"{result['date']}, `{result['command']}`, {result['machine']}; a local Ray "
        f"{ray.__version__} cluster of two nodes on this machine (1 CPU, 200 MB object store "
        f"each), actor on one, driver on the other; best of {result['repeats']} interleaved runs:",
        "",
        "| tensor | Ray object store, pipelined | tcp transport (MAC), pipelined | Ray / tcp | Ray, one at a time |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['size']} | {r['ray_ms']:.3f} ms | {r['tcp_ms']:.3f} ms | "
            f"{r['ray_over_tcp']:.1f}x | {r['ray_one_ms']:.3f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 200 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node, labels={"bench": "far"})
        ray.init(address=cluster.address, log_to_driver=False)
        rows = measure(args.quick, args.repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/bench_ray_hop.py" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))
    if args.output:
        args.output.write_text(report(result))


if __name__ == "__main__":
    main()
