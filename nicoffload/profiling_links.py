"""Measuring the links of a profile: each transport the local topology uses (tcp, shm),
through nicoffload's own sender and receiver, keyed as the agent keys them (so tcp frames carry
their MAC), not through raw sockets: what a profile says a byte costs is what moving it costs
the runtime. Both ends of an `exchange` run in this process; the CPU time of the process (every
thread) is split evenly between the two ends and fitted per end as `a + b * bytes` per batch
over several batch sizes (`cpu_ns_per_byte` is `b`, `cpu_us_per_batch` is `a`); the bandwidth
comes from another process (`stream_bandwidth`), as a stage's outputs leave an agent.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from nicoffload.profiles import LinkCost

# batch payload sizes (bytes) and how many batches of each; quick: fewer of the large ones
SIZES = (256, 64 << 10, 1 << 20, 4 << 20)
STREAM_BYTES = 16 << 20  # a batch of the bandwidth's measure (64 decoded ImageNet images: 36 MB)
BYTES_PER_SIZE = 96 << 20
QUICK_BYTES_PER_SIZE = 24 << 20
MIN_BATCHES = 400
MAX_BATCHES = 2000
SLOTS = 4


def _address(scheme: str) -> str:
    if scheme == "tcp":
        return "tcp://127.0.0.1:0"
    return f"shm://nicoffload-profile-{os.getpid()}-{secrets.token_hex(4)}"


def exchange(scheme: str, size: int, batches: int) -> tuple[float, float]:
    """Send `batches` batches of one `size`-byte tensor from a sender thread to a receiver in
    this process over `scheme`, keyed; (wall s, process CPU s) of the whole exchange."""
    from nicoffload.transport import connect, listen

    key = secrets.token_bytes(32)
    payload = np.ones(size, np.uint8)
    with listen(_address(scheme), slots=SLOTS, slot_bytes=size, key=key) as rx:
        failure: list[BaseException] = []

        def send() -> None:
            try:
                with connect(rx.address, key=key) as tx:
                    for i in range(batches):
                        tx.send({"x": payload}, request_id=i + 1, batch_size=1)
                    tx.flush(timeout=30)
            except BaseException as exc:  # re-raised below, in the caller's thread
                failure.append(exc)

        sender = threading.Thread(target=send, name=f"profile-{scheme}-sender", daemon=True)
        c0, t0 = time.process_time(), time.perf_counter()
        sender.start()
        got = 0
        while got < batches:
            d = rx.recv(timeout=30)
            if d is None:
                break
            got += 1
            rx.release(d)
        sender.join(30)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if failure:
        raise failure[0]
    if got < batches:
        raise RuntimeError(f"profile: {scheme}: {got} of {batches} batches arrived")
    return wall, cpu


def round_trip_ms(scheme: str, rounds: int = 200) -> float:
    """One small batch at a time (send, receive, release, its credit back): half the mean
    round trip, in ms: the latency a transfer adds."""
    from nicoffload.transport import connect, listen

    key = secrets.token_bytes(32)
    with listen(_address(scheme), slots=1, slot_bytes=64, key=key) as rx:
        ready = threading.Event()
        out: dict[str, Any] = {}

        def echo() -> None:
            ready.set()
            for _ in range(rounds):
                d = rx.recv(timeout=30)
                if d is None:
                    return
                rx.release(d)

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        ready.wait()
        with connect(rx.address, key=key) as tx:
            x = np.ones(64, np.uint8)
            t0 = time.perf_counter()
            for i in range(rounds):
                tx.send({"x": x}, request_id=i + 1, batch_size=1)
                tx.flush(timeout=30)
            out["s"] = time.perf_counter() - t0
        t.join(30)
    return out["s"] / rounds / 2 * 1e3


def fit_per_batch(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of CPU s per batch per end against bytes: (us per batch, ns per byte),
    neither below zero."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    b, a = np.polyfit(x, y, 1)
    return max(0.0, float(a) * 1e6), max(0.0, float(b) * 1e9)


def _stream_send() -> None:
    """The sending process of `stream_bandwidth`: argv address, size, batches; the key on
    stdin. One warm-up batch, then the timed ones."""
    from nicoffload.transport import connect

    address, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    key = bytes.fromhex(sys.stdin.readline().strip())
    if hasattr(os, "sched_setaffinity"):  # the cores a local agent gets (local_topology's
        # dpu0 share, the first ones: dpu_agents.server.pin_cores): a big batch is copied into
        # a shm slot by as many threads as the sender has cores (slots.copy_flat)
        from nicoffload.topology import local_topology

        topo = local_topology(gpu=False)
        if "dpu0" in topo.ids:
            allowed = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, allowed[: topo.device("dpu0").cores])
    payload = np.ones(size, np.uint8)
    with connect(address, key=key) as tx:
        for i in range(n + 1):
            tx.send({"x": payload}, request_id=i + 1, batch_size=1)
        tx.flush(timeout=60)


def stream_bandwidth(scheme: str, size: int, batches: int) -> float:
    """Bytes per second of `batches` batches of `size` bytes sent from another process to a
    receiver in this one, keyed: as a stage's outputs leave an agent for the host, the rate the
    planner prices the link at. Between two threads of one process (`exchange`) the same tcp
    moves 2.1-2.4x as much on the H200 host (2.8-3.2 against 1.29-1.37 GB/s, 4-36 MB batches)
    and 1.2x on the 2-core VM: the price of decode on the DPU was +102-113% off by it."""
    from nicoffload.transport import listen

    key = secrets.token_bytes(32)
    code = "from nicoffload.profiling_links import _stream_send; _stream_send()"
    with listen(_address(scheme), slots=SLOTS, slot_bytes=size, key=key) as rx:
        args = [sys.executable, "-c", code, rx.address, str(size), str(batches)]
        child = subprocess.Popen(args, stdin=subprocess.PIPE, text=True)
        try:
            assert child.stdin is not None
            child.stdin.write(key.hex() + "\n")
            child.stdin.close()
            t0 = None
            for got in range(batches + 1):
                d = rx.recv(timeout=60)
                if d is None:
                    raise RuntimeError(f"profile: {scheme}: {got} of {batches + 1} batches arrived")
                rx.release(d)
                if t0 is None:  # the warm-up batch: the process has started and connected
                    t0 = time.perf_counter()
            wall = time.perf_counter() - t0
        finally:
            if child.wait(60) != 0:
                raise RuntimeError(
                    f"profile: {scheme}: the sending process exited {child.returncode}"
                )
    return size * batches / wall


def measure_transports(*, quick: bool = False, progress=None) -> dict[str, LinkCost]:
    """tcp (keyed: every frame MAC'd) and shm, as the runtime moves bytes over them: CPU per
    byte and per batch between two threads (`exchange`), bandwidth from another process
    (`stream_bandwidth`, batches of STREAM_BYTES)."""
    per_size = QUICK_BYTES_PER_SIZE if quick else BYTES_PER_SIZE
    out: dict[str, LinkCost] = {}
    for scheme in ("tcp", "shm"):
        points = []
        for size in SIZES:
            n = min(MAX_BATCHES, max(MIN_BATCHES // (4 if quick else 1), per_size // size))
            _, cpu = exchange(scheme, size, n)
            points.append((size, cpu / n / 2))  # one end's share
            if progress:
                progress(advance=1)
        per_batch_us, per_byte_ns = fit_per_batch(points)
        bandwidth = stream_bandwidth(scheme, STREAM_BYTES, 8 if quick else 24)
        out[scheme] = LinkCost(
            round_trip_ms(scheme), bandwidth, per_byte_ns, per_batch_us, across=True
        )
    return out
