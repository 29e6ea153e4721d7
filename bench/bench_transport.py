"""Transport bandwidth and per-batch control overhead, next to the limits measured in the same run
(numpy memcpy for shm, a raw loopback TCP stream for tcp); sender and receiver in two processes.
tcp+mac is tcp with a key (every frame's MAC covers its payload), next to tcp without one.

    python bench/bench_transport.py [--quick] [--json] [--output bench/RESULTS_transport.md]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nicoffload.transport import connect, listen
from nicoffload.transport.shm import Segment
from nicoffload.transport.tcp import SEND_BUFFER

KiB, MiB = 1 << 10, 1 << 20
BATCH = 64 * 224 * 224 * 3  # 64 images of 224x224x3 uint8: a typical preprocessed batch
SIZES = [4 * KiB, 64 * KiB, MiB, BATCH, 16 * MiB, 64 * MiB]
RING = 256 * MiB  # the bandwidth runs' ring: up to 16 slots of the tensor's size, at least 4
TARGETS = {"shm": 0.70, "tcp": 0.80}  # of the limit, at >= 1 MiB
OVERHEAD_TARGET_US = 100.0
KEY = bytes(range(32))  # tcp+mac: the sender and the receiver share it (a benchmark's key)


def slots_for(size: int) -> int:
    return min(16, max(4, RING // size))


def worker(conn: mp.connection.Connection) -> None:
    """The receiving process: serves one command at a time from the parent."""
    while (cmd := conn.recv()) is not None:
        if cmd[0] == "transport":
            _, address, slots, slot_bytes, key = cmd
            with listen(address, slots=slots, slot_bytes=slot_bytes, key=key) as rx:
                conn.send(rx.address)
                count, cpu = 0, time.process_time()
                for delivery in rx:
                    rx.release(delivery)
                    count += 1
                conn.send((time.process_time() - cpu) / count)
        else:  # a raw TCP stream into a ring of the transport's footprint, then say so
            _, size = cmd
            slots = slots_for(size)
            ring = memoryview(np.empty(slots * size, np.uint8))
            with socket.create_server(("127.0.0.1", 0)) as server:
                conn.send(f"tcp://127.0.0.1:{server.getsockname()[1]}")
                sock, _ = server.accept()
                with sock:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    i, got = 0, 0
                    while k := sock.recv_into(ring[i * size + got : (i + 1) * size]):
                        got += k
                        if got == size:
                            i, got = (i + 1) % slots, 0
                    sock.sendall(b"k")
        conn.send("done")


def timed_batches(
    conn: mp.connection.Connection,
    address: str,
    slots: int,
    array: np.ndarray,
    n: int,
    key: bytes | None = None,
) -> float:
    """Seconds for n batches of `array`, from the first send to the last release."""
    return timed_batches_cpu(conn, address, slots, array, n, key)[0]


def timed_batches_cpu(
    conn: mp.connection.Connection,
    address: str,
    slots: int,
    array: np.ndarray,
    n: int,
    key: bytes | None = None,
) -> tuple[float, float, float]:
    """timed_batches, and the CPU seconds per batch of the sender and of the receiver (which,
    unlike wall time, other work on the machine hardly changes). With a `key`, the frames
    carry a MAC."""
    conn.send(("transport", address, slots, max(array.nbytes, 64), key))
    with connect(conn.recv(), timeout=10, key=key) as tx:
        for _ in range(2 * slots):  # warm: every slot touched, connection up to speed
            tx.send([array])
        tx.flush()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            tx.send([array])
        tx.flush()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    receiver_cpu = conn.recv()
    assert conn.recv() == "done"
    return elapsed, cpu / n, receiver_cpu


def timed_raw_tcp(conn: mp.connection.Connection, array: np.ndarray, n: int) -> float:
    conn.send(("raw", array.nbytes))
    host, port = conn.recv().removeprefix("tcp://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        view = memoryview(array).cast("B")
        for _ in range(2 * slots_for(array.nbytes)):  # warm, as timed_batches does
            sock.sendall(view)
        start = time.perf_counter()
        for _ in range(n):
            sock.sendall(view)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)
        elapsed = time.perf_counter() - start
    assert conn.recv() == "done"
    return elapsed


def timed_memcpy(array: np.ndarray, n: int, shared: bool = False) -> float:
    """n numpy copies into a ring of the shm transport's footprint: private memory (the limit),
    or a shared-memory segment (where the kernel may give 4 KiB pages only, not huge pages)."""
    slots = slots_for(array.nbytes)
    segment = (
        Segment(f"nico.bench-{os.getpid()}", slots * array.nbytes, create=True) if shared else None
    )
    try:
        ring = segment.array if segment else np.empty(slots * array.nbytes, np.uint8)
        ring = ring.reshape(slots, array.nbytes)
        ring.fill(1)
        src = array.view(np.uint8).reshape(-1)
        start = time.perf_counter()
        for i in range(n):
            np.copyto(ring[i % slots], src)
        return time.perf_counter() - start
    finally:
        del ring
        if segment:
            segment.close()


def bandwidth(conn: mp.connection.Connection, quick: bool, repeats: int) -> list[dict]:
    """Each transport next to its limit; the runs interleave, so noise hits both alike."""
    rows = []
    budget = 256 * MiB if quick else 1024 * MiB
    for size in SIZES:
        array = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        n = max(8, min(20000, budget // size))
        runs: dict[str, list[float]] = {k: [] for k in ("memcpy", "shared", "raw", "shm", "tcp")}
        cpu: list[tuple[float, float, float]] = []
        for _ in range(repeats):
            runs["memcpy"].append(timed_memcpy(array, n))
            runs["shared"].append(timed_memcpy(array, n, shared=True))
            runs["shm"].append(timed_batches(conn, "shm://bench", slots_for(size), array, n))
            runs["raw"].append(timed_raw_tcp(conn, array, n))
            runs["tcp"].append(timed_batches(conn, "tcp://127.0.0.1:0", slots_for(size), array, n))
            if size >= MiB:  # what the MAC costs, where it costs
                args = (conn, "tcp://127.0.0.1:0", slots_for(size), array, max(4, n // 4))
                cpu.append(timed_batches_cpu(*args))
                cpu.append(timed_batches_cpu(*args, key=KEY))
        gbs = {name: size * n / min(times) / 1e9 for name, times in runs.items()}
        if cpu:
            macs = cpu[1::2]
            runs["tcp+mac"] = [t for t, _, _ in macs]
            gbs["tcp+mac"] = size * max(4, n // 4) / min(runs["tcp+mac"]) / 1e9
            gbs["tcp-short"] = size * max(4, n // 4) / min(t for t, _, _ in cpu[::2]) / 1e9
        pairs = [("shm", "memcpy", "numpy memcpy"), ("tcp", "raw", "raw TCP")]
        if cpu:
            pairs.append(("tcp+mac", "tcp-short", "tcp, no key"))
        for kind, limit, name in pairs:
            row = {
                "transport": kind,
                "size": size,
                "slots": slots_for(size),
                "batches": n,
                "gb_s": gbs[kind],
                "us_per_batch": min(runs[kind]) / n * 1e6,
                "limit": name,
                "limit_gb_s": gbs[limit],
                "ratio": gbs[kind] / gbs[limit],
            }
            if kind == "shm":
                row["memcpy_into_shm_gb_s"] = gbs["shared"]
            if kind == "tcp+mac":
                row["batches"] = max(4, n // 4)
                row["us_per_batch"] = min(runs[kind]) / row["batches"] * 1e6
                row["cpu_ms_per_batch"] = {  # sender, receiver: without a key, then with one
                    "plain": [1e3 * min(c[i] for c in cpu[::2]) for i in (1, 2)],
                    "mac": [1e3 * min(c[i] for c in cpu[1::2]) for i in (1, 2)],
                }
            rows.append(row)
            print(
                f"  {kind} {size:>9} B: {gbs[kind]:6.2f} GB/s vs {gbs[limit]:6.2f}", file=sys.stderr
            )
    return rows


def overhead(conn: mp.connection.Connection, quick: bool, repeats: int) -> list[dict]:
    """Per-batch cost of a tiny batch: one slot (a full round trip) and a deep ring (streaming)."""
    rows, tiny = [], np.zeros(16, np.float32)
    n = 2000 if quick else 10000
    tcp = "tcp://127.0.0.1:0"
    for kind, address, key in (
        ("shm", "shm://bench", None),
        ("tcp", tcp, None),
        ("tcp+mac", tcp, KEY),
    ):
        rtt = min(timed_batches(conn, address, 1, tiny, n, key) for _ in range(repeats))
        stream = min(timed_batches_cpu(conn, address, 16, tiny, n, key) for _ in range(repeats))
        rows.append(
            {
                "transport": kind,
                "round_trip_us": rtt / n * 1e6,
                "stream_us": stream[0] / n * 1e6,
                "sender_cpu_us": stream[1] * 1e6,
                "receiver_cpu_us": stream[2] * 1e6,
            }
        )
    return rows


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        model = fields["Model name"].strip()
    except (OSError, subprocess.CalledProcessError, KeyError):
        model = platform.processor() or "unknown CPU"
    return (
        f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )


def size_name(size: int) -> str:
    if size >= MiB:
        return f"{size // MiB} MiB" if size % MiB == 0 else f"{size / MiB:.1f} MiB"
    return f"{size // KiB} KiB"


def report(result: dict) -> str:
    lines = [
        "## Transports (`bench/bench_transport.py`)",
        "",
        f"- machine: {result['machine']}",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        "- load average (1 min) before and after: {:.2f}, {:.2f}".format(*result["load"]),
        "- sender and receiver in two processes; a ring of min(16, max(4, 256 MiB / size))",
        "  slots; the limits write into a ring of the same footprint (memcpy copies into it, the",
        "  raw TCP stream is received into it, slot after slot); best of "
        f"{result['repeats']} interleaved runs of each transport and its limit.",
        "",
        "| transport | tensor | slots | GB/s | us/batch | limit | limit GB/s | % of limit | target |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in result["bandwidth"]:
        target = TARGETS.get(r["transport"], 0.0)
        verdict = "met" if r["ratio"] >= target else "**missed**"
        verdict = f"{verdict} (>= {target:.0%})" if r["size"] >= MiB and target else "-"
        lines.append(
            f"| {r['transport']} | {size_name(r['size'])} | {r['slots']} | {r['gb_s']:.2f} | "
            f"{r['us_per_batch']:.0f} | {r['limit']} | {r['limit_gb_s']:.2f} | "
            f"{100 * r['ratio']:.0f}% | {verdict} |"
        )
    lines += [
        "",
        "CPU ms per batch (sender / receiver) of tcp without a key and with one (the MAC):",
        ", ".join(
            f"{size_name(r['size'])}: {p[0]:.2f} / {p[1]:.2f} -> {m[0]:.2f} / {m[1]:.2f}"
            for r in result["bandwidth"]
            if r["transport"] == "tcp+mac"
            for p, m in [(r["cpu_ms_per_batch"]["plain"], r["cpu_ms_per_batch"]["mac"])]
        )
        + ".",
        "",
        "numpy memcpy into a shared-memory ring instead (what the shm transport's copy pays):",
        ", ".join(
            f"{size_name(r['size'])}: {r['memcpy_into_shm_gb_s']:.2f} GB/s"
            for r in result["bandwidth"]
            if r["transport"] == "shm"
        )
        + ".",
        "",
        "Per-batch control overhead, a 64-byte tensor: wall time per batch with 1 slot (a full",
        "round trip: DATA, recv, release, CREDIT) and with 16 slots (pipelined), and the CPU time",
        "per batch of each side in the pipelined run.",
        "",
        "| transport | round trip (us) | pipelined (us/batch) | sender CPU (us) | receiver CPU (us) "
        "| target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in result["overhead"]:
        verdict = "met" if r["stream_us"] < OVERHEAD_TARGET_US else "**missed**"
        lines.append(
            f"| {r['transport']} | {r['round_trip_us']:.0f} | {r['stream_us']:.0f} | "
            f"{r['sender_cpu_us']:.0f} | {r['receiver_cpu_us']:.0f} | "
            f"{verdict} (< {OVERHEAD_TARGET_US:.0f} us per batch) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer bytes and repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).with_name("RESULTS_transport.md")
    )
    args = parser.parse_args()
    repeats = 3 if args.quick else 5
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(child,), daemon=True)
    proc.start()
    try:
        load = os.getloadavg()[0]
        result = {
            "machine": machine(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + shlex.join(sys.argv),
            "repeats": repeats,
            "bandwidth": bandwidth(parent, args.quick, repeats),
            "overhead": overhead(parent, args.quick, repeats),
        }
        result["load"] = (load, os.getloadavg()[0])  # other work on the machine adds noise
    finally:
        parent.send(None)
        proc.join(10)
    text = report(result)
    write_section(args.output, text)
    print(json.dumps(result, indent=2) if args.json else text)


BEGIN, END = "<!-- bench_transport: begin -->", "<!-- bench_transport: end -->"


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of `path` (between its markers), keeping the rest."""
    old = path.read_text() if path.exists() else ""
    head, _, rest = old.partition(BEGIN)
    tail = rest.partition(END)[2] if rest else ""
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail or chr(10)}")


if __name__ == "__main__":
    main()
