"""Measuring the links of this machine as the runtime uses them (`nicoffload profile`).

Each transport the local topology uses (tcp, shm) is measured through nicoffload's own
sender and receiver, keyed as the agent keys them (so tcp frames carry their MAC), not through
raw sockets: what a profile says a byte costs is what moving it costs the runtime. Both ends
run in this process; the CPU time of the process (every thread) over an exchange is split
evenly between the two ends, and fitted per end as `a + b * bytes` per batch over several
batch sizes: `cpu_ns_per_byte` is `b`, `cpu_us_per_batch` is `a`.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from nicoffload.profiles import LinkCost

# batch payload sizes (bytes) and how many batches of each; quick: fewer of the large ones
SIZES = (256, 64 << 10, 1 << 20, 4 << 20)
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


def measure_transports(*, quick: bool = False, progress=None) -> dict[str, LinkCost]:
    """tcp (keyed: every frame MAC'd) and shm, as the runtime moves bytes over them."""
    per_size = QUICK_BYTES_PER_SIZE if quick else BYTES_PER_SIZE
    out: dict[str, LinkCost] = {}
    for scheme in ("tcp", "shm"):
        points, bandwidth = [], 0.0
        for size in SIZES:
            n = min(MAX_BATCHES, max(MIN_BATCHES // (4 if quick else 1), per_size // size))
            wall, cpu = exchange(scheme, size, n)
            points.append((size, cpu / n / 2))  # one end's share
            if size == SIZES[-1]:
                bandwidth = size * n / wall
            if progress:
                progress(advance=1)
        per_batch_us, per_byte_ns = fit_per_batch(points)
        out[scheme] = LinkCost(round_trip_ms(scheme), bandwidth, per_byte_ns, per_batch_us)
    return out


def measure_runtime(*, quick: bool = False) -> float:
    """The host runtime's CPU per item outside the kernels, in us: a Session of the ResNet
    pipeline all on the host over tiny JPEGs (so the kernels are cheap and what is left is the
    runtime's own work), batches read in place as `run` and a serving loop read them; this
    process's CPU over the call minus what its kernels took, per item."""
    import io
    from pathlib import Path

    from PIL import Image

    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runner import RunStats, prepare
    from nicoffload.session import Session

    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buf, "JPEG")
    pipeline = load_pipeline(Path(__file__).parent / "data" / "runtime_probe.yaml")
    items = [buf.getvalue()] * (512 if quick else 2048)
    with Session(prepare(pipeline, single_device_plan(pipeline))) as session:
        for _ in session.stream(items[:128]):  # warm: kernels compiled, rings touched
            pass
        stats = RunStats()
        c0 = time.process_time()
        for _ in session.stream(items, stats):
            pass
        cpu = time.process_time() - c0
    kernels_ms = sum(st["ms_per_item"] for st in stats.stages.values())
    return max(0.0, cpu * 1e6 / len(items) - kernels_ms * 1e3)


def _agent_cpu_s() -> float:
    """CPU seconds of this process's local agents (children running dpu_agents.server)."""
    from pathlib import Path

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"dpu_agents.server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (FileNotFoundError, ProcessLookupError):
                continue
    return total


def measure_agent_runtime(link: LinkCost, *, quick: bool = False) -> float | None:
    """The DPU agent's own CPU per item outside its kernels and its transfers, in us: the
    runtime probe (the ResNet recipe over tiny JPEGs) all on an agent started on these cores,
    as the local topology runs one, over tcp; the agent process's CPU over the calls minus
    what its kernels took (the agent's own figure) and minus both its transfers as `link`
    prices them, per item. None where no agent can run beside the host (one core)."""
    import io
    from pathlib import Path

    from PIL import Image

    from nicoffload.graph import load_pipeline
    from nicoffload.planner.plan import single_device_plan
    from nicoffload.runner import RunStats, prepare
    from nicoffload.session import Session
    from nicoffload.topology import local_topology

    topology = local_topology(gpu=False)
    if "dpu0" not in topology.ids:
        return None
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(buf, "JPEG")
    pipeline = load_pipeline(Path(__file__).parent / "data" / "agent_probe.yaml")
    items = [buf.getvalue()] * (512 if quick else 2048)
    plan = single_device_plan(pipeline, "dpu0")
    with Session(prepare(pipeline, plan, topology), workers=1) as session:
        for _ in session.stream(items[:128]):  # warm: kernels compiled, rings touched
            pass
        stats = RunStats()
        c0 = _agent_cpu_s()
        batches = 0
        for _ in session.stream(items, stats):
            batches += 1
        cpu = _agent_cpu_s() - c0
    kernels_ms = sum(st["ms_per_item"] for st in stats.stages.values())
    out_bytes = sum(s.typical_nbytes for s in pipeline.output_specs().values())
    moved_us = link.cpu_ns_per_byte * (out_bytes + len(items[0])) * 1e-3 + 2 * (
        link.cpu_us_per_batch or 0.0
    ) * batches / len(items)
    return max(0.0, cpu * 1e6 / len(items) - kernels_ms * 1e3 - moved_us)
