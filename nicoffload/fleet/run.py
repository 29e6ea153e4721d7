"""`simulate(fleet, policies)`: each policy's goodput, host CPU saved and latency over a fleet.

One representative server per kind is simulated and its figures scaled by the kind's count.
That is exact in distribution, not an approximation of it: the mix's fleet-wide Poisson streams
are spread evenly over the servers (random balancing), and a Poisson stream split at random is
independent Poisson streams of the shares' rates, so every server of a kind sees the same
independent load and behaves as the representative does. The cost is then one server's events
per kind (a 1,000-server fleet of two kinds simulates as two servers), where simulating every
server would cost 500 times more and tell nothing more (the percentiles are estimated from one
server's items, so their noise is one server's: a longer `duration` narrows it); what one kind's
servers do to another (a shared pool, a cross-server planner) would need more, and is not
modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from nicoffload.fleet.model import POLICIES, Route, StreamModel, Visit, stream_model
from nicoffload.fleet.servers import NIC, server_topology
from nicoffload.fleet.sim import Offered, StreamRun, simulate_server
from nicoffload.fleet.spec import Fleet, Nic
from nicoffload.graph import Pipeline, load_pipeline, with_typical


@dataclass(frozen=True)
class StreamResult:
    """One (server kind, pipeline) under one policy, for the whole kind."""

    kind: str
    pipeline: str
    servers: int
    placement: dict[str, str]
    offered_per_s: float
    goodput_per_s: float
    host_cpu_ms_per_item: float  # simulated: host busy ms per completed item
    p50_ms: float | None
    p99_ms: float | None
    predicted_per_s: float  # the planner's throughput for one server alone, times the servers
    predicted_host_cpu_ms_per_item: float
    unfinished: int  # of the representative's items, still queued at the end


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    offered_per_s: float
    goodput_per_s: float
    host_cpu_cores: float  # host cores busy, fleet-wide
    # against all-host's host CPU per item at the same load (simulated), at this goodput
    host_cpu_saved_cores: float
    host_cpu_saved_share: float  # of all-host's host CPU at that goodput
    p50_ms: float | None
    p99_ms: float | None
    saturated: bool  # some kind completes less than it is offered (2% slack)
    streams: tuple[StreamResult, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class FleetResult:
    fleet: str
    servers: int
    duration_s: float
    policies: tuple[PolicyResult, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def with_nic(model: StreamModel, nic: Nic | None, nbytes: float) -> StreamModel:
    """The model with the server's network port in front: the request's bytes over its
    bandwidth, and its latency."""
    if nic is None:
        return model

    def front(route: Route | None) -> Route | None:
        if route is None:
            return None
        return Route(
            (Visit(NIC, nbytes / nic.bandwidth * 1e3), *route.visits),
            route.delay_ms + nic.latency_ms,
        )

    capacity = {**(model.capacity or {}), NIC: 1.0}
    return replace(
        model, route=front(model.route), assist_route=front(model.assist_route), capacity=capacity
    )


def _pipeline(path: str, typical: dict[str, dict[str, float]]) -> Pipeline:
    p = load_pipeline(path)
    return with_typical(p, typical) if typical else p


def _quantiles(samples: Sequence[tuple[np.ndarray, float]], qs=(0.5, 0.99)) -> list[float | None]:
    """Quantiles of latencies pooled over kinds, each sample weighted by its kind's servers."""
    parts = [(s, w) for s, w in samples if len(s)]
    if not parts:
        return [None for _ in qs]
    values = np.concatenate([s for s, _ in parts])
    weights = np.concatenate([np.full(len(s), w) for s, w in parts])  # a sample per server
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    return [round(float(values[order][np.searchsorted(cum, q * cum[-1])]), 4) for q in qs]


def simulate(
    fleet: Fleet,
    policies: Sequence[str] = POLICIES,
    duration_s: float | None = None,
    seed: int | None = None,
) -> FleetResult:
    """Simulate `fleet` under each policy (`fleet.model.POLICIES`) for `duration_s` of
    simulated time (the fleet file's by default; the first tenth is warm-up)."""
    duration = duration_s or fleet.duration_s
    seed = fleet.seed if seed is None else seed
    pipelines = [_pipeline(d.pipeline, d.typical) for d in fleet.mix]
    topologies = [server_topology(k) for k in fleet.servers]
    runs = {
        p: _policy(fleet, pipelines, topologies, p, duration, seed)
        for p in dict.fromkeys(("all-host", *policies))
    }
    # (kind, pipeline) -> the host ms per item all-host spends at this load, simulated on the
    # same arrivals: its batches are as full as this load makes them, as the policy's are
    baseline = {(s.kind, s.pipeline): s.host_cpu_ms_per_item for s, _ in runs["all-host"]}
    return FleetResult(
        fleet.name, fleet.count, duration, tuple(_result(p, runs[p], baseline) for p in policies)
    )


def _policy(fleet, pipelines, topologies, policy, duration, seed):
    """(StreamResult, its representative's StreamRun) per kind and pipeline under `policy`."""
    out = []
    for i, k in enumerate(fleet.servers):
        models = [
            with_nic(stream_model(p, topologies[i], k.profiles, policy), k.nic, _bytes(p))
            for p in pipelines
        ]
        capacity = {s: c for m in models for s, c in (m.capacity or {}).items()}
        host = frozenset().union(*(m.host for m in models))
        share = [
            Offered(m, d.rate_per_s / fleet.count) for m, d in zip(models, fleet.mix, strict=True)
        ]
        for m, run in zip(
            models, simulate_server(capacity, host, share, duration, seed + i), strict=True
        ):
            out.append((_stream(k.name, k.count, m, run), run))
    return out


def _result(policy: str, runs, baseline: dict[tuple[str, str], float]) -> PolicyResult:
    saved = base_cpu = host_cores = 0.0
    for s, run in runs:
        base = baseline[s.kind, s.pipeline]
        saved += s.goodput_per_s * (base - s.host_cpu_ms_per_item) / 1e3
        base_cpu += s.goodput_per_s * base / 1e3
        host_cores += run.host_cpu_ms / 1e3 / run.window_s * s.servers
    streams = tuple(s for s, _ in runs)
    p50, p99 = _quantiles([(run.latencies_ms, float(s.servers)) for s, run in runs])
    return PolicyResult(
        policy,
        round(sum(s.offered_per_s for s in streams), 3),
        round(sum(s.goodput_per_s for s in streams), 3),
        round(host_cores, 4),
        round(saved, 4),
        round(saved / base_cpu, 4) if base_cpu > 0 else 0.0,
        p50,
        p99,
        any(s.goodput_per_s < 0.98 * s.offered_per_s for s in streams),
        streams,
    )


def _bytes(p: Pipeline) -> float:
    return float(sum(spec.typical_nbytes for spec in p.inputs.values()))


def _stream(kind: str, count: int, m: StreamModel, run: StreamRun) -> StreamResult:
    lat = run.latencies_ms
    done = run.goodput_per_s * run.window_s
    return StreamResult(
        kind,
        m.pipeline,
        count,
        m.placement,
        round(run.offered_per_s * count, 3),
        round(run.goodput_per_s * count, 3),
        round(run.host_cpu_ms / done, 6) if done else 0.0,
        round(float(np.quantile(lat, 0.5)), 4) if len(lat) else None,
        round(float(np.quantile(lat, 0.99)), 4) if len(lat) else None,
        round(m.predicted.throughput_per_s * count, 3),
        m.host_cpu_ms_per_item,
        run.unfinished,
    )
