"""A load generator for an Open Inference Protocol endpoint (`nicoffload serve`, or any server
with one BYTES input), over HTTP (aiohttp) or gRPC (grpcio's asyncio client, a URL
`grpc://HOST:PORT`): open loop (Poisson arrivals at a rate, every request sent at its time
whatever the server does) or closed loop (C clients, each sending its next request when its
last is answered); what it measured, summarized (`summarize`), and plotted (`plot`).

An open-loop request's latency runs from the moment it was due to be sent, so a client that
falls behind its schedule counts against the server (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.serve.clock import clock_id, now_ns
from nicoffload.serve.kserve import HEADER_LENGTH, pack_bytes

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}
# A request's parts in the order its time passes, each a measured interval that ends where the
# next begins (the client's own, the way to the server and back, the server's: `serve`'s
# response parameters; batcher._timings and server.infer say what each covers). Where the
# papers' names fall: receive = request + receive; decode, preprocess and transfer = dpu + host
# (the agent's stages and the transfers both ways; the host's stages); inference = model;
# response send = encode + response; queueing and batching = queue, admit, batch_wait, batch,
# order, answer, resume.
PARTS = (
    "client_us",  # loadgen: from when the request was due to when it began to send it
    "request_us",  # sent -> the server's handler began (connect, send, aiohttp's or grpc's parsing)
    "receive_us",
    "forward_us",  # serve --fronts: the front process to the Session's (the control socket)
    "queue_us",
    "admit_us",
    "batch_wait_us",
    "dpu_us",
    "host_us",
    "batch_us",
    "order_us",
    "pipeline_us",  # instead of admit .. order, from an executor without row stamps
    "model_us",
    "answer_us",
    "resume_us",
    "encode_us",
    "response_us",  # the server handed the response to aiohttp (grpc) -> loadgen read it
)
GRPC = "grpc://"
# the RPC that loadgen sends its requests to, serialized once each (`grpc_request_body`)
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(frozen=True)
class Result:
    """One request: its status (HTTP's; 0: no response, the connection failed; over gRPC 200
    for OK, else the gRPC code's name, "UNAVAILABLE"), latency and the timing breakdown the
    server put in the response's parameters."""

    status: int | str
    latency_s: float
    timings: dict[str, float] = field(default_factory=dict)


def _mean_parts(results: Sequence[Result]) -> dict[str, float]:
    """The mean of each part (ms) over `results`, in PARTS' order, with `server_ms` (the
    server's own total); a part a request lacks counts as 0 for it."""
    keys = {k for r in results for k in r.timings if k.endswith("_us")}
    order = [k for k in PARTS if k in keys] + sorted(keys - set(PARTS))
    return {
        k[: -len("_us")] + "_ms": round(
            float(np.mean([r.timings.get(k, 0) for r in results])) / 1e3, 3
        )
        for k in order
    }


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
    requests, errors by status, and the mean of each part (PARTS, ms) of the answered requests,
    over all of them (`breakdown_ms`) and over the slowest 1% (`tail_breakdown_ms`).
    `attributed_ratio`: the parts' sum over the mean end-to-end latency; `unattributed_ms`
    what they leave of it (the parts a request could not measure: the way to the server and
    back when it runs on another kernel)."""
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
            for k, v in sorted(
                Counter(r.status for r in results if r.status != 200).items(),
                key=lambda kv: str(kv[0]),
            )
        },
        "latency_ms": {
            k: (round(float(np.percentile(lat_ms, q)), 3) if len(ok) else None)
            for k, q in PERCENTILES.items()
        },
        "mean_latency_ms": round(float(lat_ms.mean()), 3) if len(ok) else None,
    }
    breakdown = _mean_parts(ok)
    if doc["mean_latency_ms"] is not None:
        # what the measured parts leave of the end-to-end latency: 0 when every part is there
        attributed = sum(v for k, v in breakdown.items() if k[:-3] + "_us" in PARTS)
        breakdown["unattributed_ms"] = round(doc["mean_latency_ms"] - attributed, 3)
        doc["attributed_ratio"] = (
            round(attributed / doc["mean_latency_ms"], 3) if doc["mean_latency_ms"] else None
        )
        # the same parts for the slowest 1% alone: what makes the tail
        slow = [r for r in ok if r.latency_s * 1e3 >= doc["latency_ms"]["p99"]]
        doc["tail_breakdown_ms"] = _mean_parts(slow)
        doc["tail_latency_mean_ms"] = round(float(np.mean([r.latency_s for r in slow])) * 1e3, 3)
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


def grpc_request_body(model: str, input_name: str, elements: list[bytes]) -> bytes:
    """A gRPC ModelInferRequest of one BYTES input (raw_input_contents), serialized."""
    from nicoffload.serve import kserve_pb

    service_pb2 = kserve_pb.pb()
    msg = service_pb2.ModelInferRequest(model_name=model)
    msg.inputs.add(name=input_name, datatype="BYTES", shape=[len(elements)])
    msg.raw_input_contents.append(pack_bytes(elements))
    return msg.SerializeToString()


def _timings(
    params: dict[str, Any], clock: str, start: float, sent: float, sent_ns: int, done_ns: int
) -> dict[str, float]:
    """A response's timing parameters with loadgen's own parts: `client_us`, and with the
    server on this kernel's clock (`clock`, its responses' `clock` parameter) the way there
    and back, measured from its `arrived_ns` and `server_us`."""
    timings = {
        k: v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    timings["client_us"] = round((sent - start) * 1e6)
    if clock and params.get("clock") == clock and "arrived_ns" in timings:
        left_ns = timings["arrived_ns"] + timings.get("server_us", 0) * 1000
        timings["request_us"] = round((timings["arrived_ns"] - sent_ns) / 1e3)
        timings["response_us"] = round((done_ns - left_ns) / 1e3)
    timings.pop("arrived_ns", None)
    return timings


Send = Callable[[Any, float], Awaitable[Result]]  # (a request body, when it was due) -> Result


@contextlib.asynccontextmanager
async def _http(
    url: str, token: str | None, connections: int, timeout_s: float
) -> AsyncIterator[Send]:
    import aiohttp

    auth = {"Authorization": f"Bearer {token}"} if token else {}
    clock = clock_id()
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(request: tuple[bytes, dict[str, str]], start: float) -> Result:
            body, headers = request
            sent, sent_ns = time.perf_counter(), now_ns()
            try:
                async with session.post(url, data=body, headers=headers | auth) as resp:
                    raw = await resp.read()
                    latency, done_ns = time.perf_counter() - start, now_ns()
                    timings: dict[str, float] = {}
                    if resp.status == 200:
                        n = int(resp.headers.get(HEADER_LENGTH, len(raw)))
                        params = json.loads(raw[:n]).get("parameters") or {}
                        timings = _timings(params, clock, start, sent, sent_ns, done_ns)
                    return Result(resp.status, latency, timings)
            except (TimeoutError, aiohttp.ClientError, OSError):
                return Result(0, time.perf_counter() - start)

        yield send


@contextlib.asynccontextmanager
async def _grpc(url: str, token: str | None, timeout_s: float) -> AsyncIterator[Send]:
    """gRPC to `grpc://HOST:PORT`: one channel (HTTP/2 carries the requests side by side), the
    requests sent as serialized once (`grpc_request_body`)."""
    try:
        import grpc
    except ImportError as exc:
        from nicoffload.errors import MissingDependency

        raise MissingDependency("grpcio", "grpc", "loadgen over gRPC") from exc
    from nicoffload.serve import kserve_pb

    response_type = kserve_pb.pb().ModelInferResponse
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    clock = clock_id()
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(url[len(GRPC) :].rstrip("/"), options=options) as ch:
        infer = ch.unary_unary(MODEL_INFER, response_deserializer=response_type.FromString)

        async def send(body: bytes, start: float) -> Result:
            sent, sent_ns = time.perf_counter(), now_ns()
            try:
                resp = await infer(body, metadata=metadata, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                return Result(exc.code().name, time.perf_counter() - start)
            latency, done_ns = time.perf_counter() - start, now_ns()
            params = {k: kserve_pb.parameter(v) for k, v in resp.parameters.items()}
            return Result(200, latency, _timings(params, clock, start, sent, sent_ns, done_ns))

        yield send


async def run_load(
    url: str,
    bodies: Sequence[Any],
    duration_s: float,
    rate: float | None = None,
    concurrency: int | None = None,
    token: str | None = None,
    seed: int = 0,
) -> tuple[list[Result], float]:
    """Open loop at `rate`, or closed loop with `concurrency` clients, for `duration_s`; the
    request bodies are used in turn: `request_body`'s for an HTTP URL, `grpc_request_body`'s
    for `grpc://HOST:PORT`. Returns the results and the run's wall time (until the last
    answer)."""
    timeout_s = max(60.0, duration_s * 2)
    if url.startswith(GRPC):
        sender = _grpc(url, token, timeout_s)
    else:
        sender = _http(url, token, 0 if rate is not None else concurrency or 1, timeout_s)
    async with sender as send:
        t0 = time.perf_counter()
        if rate is not None:
            tasks = []
            for i, at in enumerate(arrivals(rate, duration_s, seed)):
                due = t0 + float(at)
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.ensure_future(send(bodies[i % len(bodies)], due)))
            results = list(await asyncio.gather(*tasks))
        else:
            results = []
            counter = iter(range(1 << 62))

            async def client() -> None:
                while time.perf_counter() - t0 < duration_s:
                    body = bodies[next(counter) % len(bodies)]
                    results.append(await send(body, time.perf_counter()))

            await asyncio.gather(*(client() for _ in range(concurrency or 1)))
        return results, time.perf_counter() - t0


def _share(
    url: str,
    bodies: Sequence[Any],
    duration_s: float,
    rate: float | None,
    concurrency: int | None,
    token: str | None,
    seed: int,
    at: float,
) -> tuple[list[Result], float, float]:
    """One process's share of a run, begun at `at` (time.monotonic, which every process of
    this kernel reads alike): its results, wall time and CPU seconds."""
    time.sleep(max(0.0, at - time.monotonic()))
    cpu = time.process_time()
    from nicoffload.serve import eventloop

    results, wall = eventloop.run(run_load(url, bodies, duration_s, rate, concurrency, token, seed))
    return results, wall, time.process_time() - cpu


def _warm(seconds: float) -> int:
    import aiohttp  # noqa: F401  (what a share imports, imported before it is timed)

    time.sleep(seconds)
    import os

    return os.getpid()


def pool(procs: int) -> Any:
    """A pool of `procs` spawned load processes (not forked: a fork of a process that ran
    asyncio, or a Session, is unsafe), each started and its imports done."""
    import concurrent.futures
    import multiprocessing

    p = concurrent.futures.ProcessPoolExecutor(
        procs, mp_context=multiprocessing.get_context("spawn")
    )
    list(p.map(_warm, [0.5] * procs))  # P jobs at once: P processes, each one job
    return p


def run_procs(
    pool: Any,
    procs: int,
    url: str,
    bodies: Sequence[Any],
    duration_s: float,
    rate: float | None = None,
    concurrency: int | None = None,
    token: str | None = None,
    seed: int = 0,
) -> tuple[list[Result], float, float, int]:
    """`run_load` spread over `procs` processes of `pool` (a ProcessPoolExecutor; spawned, not
    forked, is best): open loop, `procs` Poisson streams of rate/procs (seeds seed, seed+1, ..;
    together one Poisson stream of `rate`); closed loop, the `concurrency` clients dealt out.
    Every request's own Result comes back, so percentiles are of all the latencies, not an
    average of each process's. Returns the results, the wall time (the longest share's), the
    CPU seconds of all the shares, and the processes used."""
    n = procs if rate is not None else min(procs, concurrency or 1)
    clients = concurrency or 1
    shares = [clients // n + (i < clients % n) for i in range(n)]
    at = time.monotonic() + 0.3  # every share starts together, once spawned and imported
    jobs = [
        pool.submit(
            _share,
            url,
            bodies,
            duration_s,
            None if rate is None else rate / n,
            None if rate is not None else shares[i],
            token,
            seed + i,
            at,
        )
        for i in range(n)
    ]
    done = [j.result() for j in jobs]
    results = [r for d in done for r in d[0]]
    return results, max(d[1] for d in done), sum(d[2] for d in done), n


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
        for k in [p[: -len("_us")] + "_ms" for p in PARTS] + ["unattributed_ms"]
        if any(k in r["breakdown_ms"] for r in runs)
    ]
    bottom = np.zeros(len(runs))
    labels = [f"{v:g}" for v in x]
    colors = plt.get_cmap("tab20")(np.arange(len(stages)) % 20)
    for k, color in zip(stages, colors, strict=True):
        vals = np.array([max(0.0, r["breakdown_ms"].get(k, 0.0)) for r in runs])
        ax2.bar(labels, vals, bottom=bottom, label=k[: -len("_ms")], color=color)
        bottom += vals
    ax2.plot(labels, [r["mean_latency_ms"] or 0.0 for r in runs], "k_", ms=18, label="end to end")
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_ylabel("mean per request (ms)")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
