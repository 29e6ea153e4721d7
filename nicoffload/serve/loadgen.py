"""A load generator for an Open Inference Protocol endpoint (`nicoffload serve`, or any server
with one BYTES input): open loop (Poisson arrivals at a rate, every request sent at its time
whatever the server does) or closed loop (C clients, each sending its next request when its
last is answered); what it measured, summarized (`summarize`), and plotted (`plot`).

An open-loop request's latency runs from the moment it was due to be sent, so a client that
falls behind its schedule counts against the server (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.serve.kserve import HEADER_LENGTH, pack_bytes

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}


@dataclass(frozen=True)
class Result:
    """One request: its status (0: no response, the connection failed), latency and the
    timing breakdown the server put in the response's parameters."""

    status: int
    latency_s: float
    timings: dict[str, float] = field(default_factory=dict)


def arrivals(rate: float, duration_s: float, seed: int = 0) -> np.ndarray:
    """Poisson arrival times (seconds from the start) in [0, duration_s)."""
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 1.5 + 10 * np.sqrt(rate * duration_s) + 10)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    while t[-1] < duration_s:  # not enough drawn (vanishingly rare): draw more
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return t[t < duration_s]


def summarize(
    results: Sequence[Result], duration_s: float, offered: float | None
) -> dict[str, Any]:
    """Goodput (answered 200 per second of the run), latency percentiles of the answered
    requests, errors by status, and the mean per-stage breakdown (ms) from their parameters.
    `unattributed_ms` is the mean end-to-end latency the server's own `server_us` does not
    cover: the network, the response's encoding and sending, the client."""
    ok = [r for r in results if r.status == 200]
    lat_ms = np.array([r.latency_s * 1e3 for r in ok])
    doc: dict[str, Any] = {
        "offered_per_s": offered,
        "duration_s": round(duration_s, 3),
        "sent": len(results),
        "ok": len(ok),
        "goodput_per_s": round(len(ok) / duration_s, 3) if duration_s > 0 else 0.0,
        "errors_by_status": {
            str(k): v
            for k, v in sorted(Counter(r.status for r in results if r.status != 200).items())
        },
        "latency_ms": {
            k: (round(float(np.percentile(lat_ms, q)), 3) if len(ok) else None)
            for k, q in PERCENTILES.items()
        },
        "mean_latency_ms": round(float(lat_ms.mean()), 3) if len(ok) else None,
    }
    keys = sorted({k for r in ok for k in r.timings if k.endswith("_us")})
    breakdown = {
        k[: -len("_us")] + "_ms": round(float(np.mean([r.timings.get(k, 0) for r in ok])) / 1e3, 3)
        for k in keys
    }
    if "server_ms" in breakdown and doc["mean_latency_ms"] is not None:
        breakdown["unattributed_ms"] = round(doc["mean_latency_ms"] - breakdown["server_ms"], 3)
    doc["breakdown_ms"] = breakdown
    return doc


def request_body(input_name: str, elements: list[bytes]) -> tuple[bytes, dict[str, str]]:
    """A binary infer request of one BYTES input, asking for binary outputs."""
    data = pack_bytes(elements)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "datatype": "BYTES",
                    "shape": [len(elements)],
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return head + data, {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}


async def _send(
    session: Any, url: str, body: bytes, headers: dict[str, str], start: float
) -> Result:
    import aiohttp

    try:
        async with session.post(url, data=body, headers=headers) as resp:
            raw = await resp.read()
            latency = time.perf_counter() - start
            timings: dict[str, float] = {}
            if resp.status == 200:
                n = int(resp.headers.get(HEADER_LENGTH, len(raw)))
                params = json.loads(raw[:n]).get("parameters") or {}
                timings = {k: v for k, v in params.items() if isinstance(v, (int, float))}
            return Result(resp.status, latency, timings)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return Result(0, time.perf_counter() - start)


async def run_load(
    url: str,
    bodies: list[tuple[bytes, dict[str, str]]],
    duration_s: float,
    rate: float | None = None,
    concurrency: int | None = None,
    token: str | None = None,
    seed: int = 0,
) -> tuple[list[Result], float]:
    """Open loop at `rate`, or closed loop with `concurrency` clients, for `duration_s`; the
    request bodies are used in turn. Returns the results and the run's wall time (until the
    last answer)."""
    import aiohttp

    auth = {"Authorization": f"Bearer {token}"} if token else {}
    connector = aiohttp.TCPConnector(limit=0 if rate is not None else concurrency or 1)
    timeout = aiohttp.ClientTimeout(total=max(60.0, duration_s * 2))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        if rate is not None:
            tasks = []
            for i, at in enumerate(arrivals(rate, duration_s, seed)):
                due = t0 + float(at)
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                body, headers = bodies[i % len(bodies)]
                tasks.append(asyncio.ensure_future(_send(session, url, body, headers | auth, due)))
            results = list(await asyncio.gather(*tasks))
        else:
            results = []
            counter = iter(range(1 << 62))

            async def client() -> None:
                while time.perf_counter() - t0 < duration_s:
                    body, headers = bodies[next(counter) % len(bodies)]
                    results.append(
                        await _send(session, url, body, headers | auth, time.perf_counter())
                    )

            await asyncio.gather(*(client() for _ in range(concurrency or 1)))
        return results, time.perf_counter() - t0


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Latency (p50, p99) against offered load, and the mean breakdown per run, stacked."""
    try:
        import matplotlib
    except ImportError as exc:
        from nicoffload.errors import MissingDependency

        raise MissingDependency("matplotlib", "plot", "loadgen --plot") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [r["offered_per_s"] if r["offered_per_s"] is not None else r["goodput_per_s"] for r in runs]
    for key in ("p50", "p99"):
        ax1.plot(x, [r["latency_ms"][key] for r in runs], marker="o", label=key)
    ax1.set_xlabel("offered load (requests/s; closed loop: goodput)")
    ax1.set_ylabel("latency (ms)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    stages = [
        k
        for k in ("receive_ms", "queue_ms", "pipeline_ms", "model_ms", "unattributed_ms")
        if any(k in r["breakdown_ms"] for r in runs)
    ]
    bottom = np.zeros(len(runs))
    labels = [f"{v:g}" for v in x]
    for k in stages:
        vals = np.array([max(0.0, r["breakdown_ms"].get(k, 0.0)) for r in runs])
        ax2.bar(labels, vals, bottom=bottom, label=k[: -len("_ms")])
        bottom += vals
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_ylabel("mean per request (ms)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
