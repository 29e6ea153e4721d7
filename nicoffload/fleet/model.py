"""A server's queueing model under a placement policy, from the planner's own cost model.

A policy chooses a plan for each pipeline of the mix (the planner's, or a fixed placement); the
plan's cost model then gives what an item asks of each resource on its way: the stations it
visits in order (a device, a directed hop of a link), its ms of one server of each (a device's
core-ms: its nodes, its transfer ends, the host runtime's own; a hop's bytes over bandwidth),
the part of a host stage's time that holds the host process's interpreter, and the links'
propagation delay. Pure functions of their inputs, as the planner is: nothing is measured here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nicoffload.errors import PlanError
from nicoffload.graph import Pipeline
from nicoffload.planner.plan import Plan, Predicted

HOST = "cpu"  # the host device of a topology (`planner.assist.HOST`)
POLICIES = ("all-host", "planner", "planner+assist", "min-host-cpu")


@dataclass(frozen=True)
class Visit:
    """A batch's service at one station: `ms` per item and `batch_ms` per batch on its
    servers, of which `serial_ms` per item and `serial_batch_ms` per batch with the host
    process's interpreter held (a host stage's GIL-held part)."""

    station: str
    ms: float
    serial_ms: float = 0.0
    batch_ms: float = 0.0
    serial_batch_ms: float = 0.0


@dataclass(frozen=True)
class Route:
    visits: tuple[Visit, ...]
    delay_ms: float  # propagation on the links, no queue


@dataclass(frozen=True)
class StreamModel:
    """One pipeline served by one server under one policy."""

    pipeline: str
    policy: str
    route: Route
    batch_max_size: int
    batch_max_wait_ms: float
    host_cpu_ms_per_item: float  # the planner's prediction
    predicted: Predicted
    placement: dict[str, str]
    # host assist: the host's copy of the pipeline (`assist_route`) takes a share of a batch's
    # rows, starting at `assist_share`, when the agent's station (`assist_station`) already
    # holds a batch's items (`runtime.assist`)
    assist_route: Route | None = None
    assist_station: str | None = None
    # station -> its parallel servers (a device's capacity; a link's hop: 1), and which are
    # the host's CPU
    capacity: dict[str, float] | None = None
    host: frozenset[str] = frozenset()
    assist_share: float = 0.0


def _demand(model: Any, best: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
    """Each resource's ms per item under the placement (its work and the runtime's own), and
    each device's ms per item of the host interpreter per stage."""
    from nicoffload.planner.evaluate import evaluate, fast_path

    m = evaluate(model, best[None, :])
    base = model.base if model.base is not None else np.zeros(len(model.resources))
    demand = {k: float(x) for k, x in zip(model.resources, m.work[0] + base, strict=True)}
    if model.serial is None:
        return demand, np.zeros(len(model.devices))
    return demand, model.serial[0 if fast_path(model, best[None, :])[0] else 1]


def _per_batch(at_size: float, at_one: float, size: int) -> tuple[float, float]:
    """(per item, per batch) from a figure priced per item at batches of `size` and of 1:
    the cost model shares a per-batch cost among a full batch's items, while the runtime's
    batches are as full as the load makes them."""
    if size <= 1:
        return at_one, 0.0
    batch = max(0.0, (at_one - at_size) * size / (size - 1))
    return at_size - batch / size, batch


def _route(plan: Plan, model: Any, single: Any, best: np.ndarray, size: int) -> Route:
    """The stations an item of `plan` visits, in order, with their service; `model` prices
    batches of `size`, `single` batches of one (the difference is the per-batch part)."""
    demand, serial_row = _demand(model, best)
    demand1, serial1 = _demand(single, best)
    visits: list[Visit] = []
    placed: dict[str, float] = {}  # station -> ms per item already given to its visits
    delay = 0.0

    def hops(transfers) -> None:
        nonlocal delay
        for t in transfers:
            if not t.link:
                continue
            ends = t.link.split("->")
            src, dst = model.devices.index(ends[0]), model.devices.index(ends[-1])
            delay += float(model.route_ms[src, dst])
            for a, b in itertools.pairwise(ends):
                hop = f"{a}->{b}"
                if hop not in placed and demand.get(hop, 0.0) > 0:
                    visits.append(Visit(hop, demand[hop]))
                    placed[hop] = demand[hop]

    hops(t for t in plan.io_transfers if t.src_stage == "ingress")
    for st in plan.stages:
        d = model.devices.index(st.device)
        ms = float(st.predicted_ms_per_item or 0.0)
        serial, serial_batch = _per_batch(float(serial_row[d]), float(serial1[d]), size)
        if model.host[d]:
            serial = min(serial, ms)  # part of the host stage's own time
        elif not model.kinds or model.kinds[d] not in ("dpu", "gpu"):
            serial = serial_batch = 0.0
        # (a DPU stage's, on the general path, is the host process's, beside the DPU's work:
        # it hands the rows to the agent and puts what comes back into the batch; a GPU
        # stage's is the host's Python that feeds the GPU and hands its batches on)
        # a stage's per-batch interpreter time is the runtime's per-batch work on the host:
        # CPU time the cost model shares over a full batch, paid by every batch here
        visits.append(Visit(st.device, ms, serial, serial_batch, serial_batch))
        placed[st.device] = placed.get(st.device, 0.0) + ms
        hops(t for t in plan.transfers if t.src_stage == st.name)
        hops(t for t in plan.io_transfers if t.src_stage == st.name)
    # what a device does besides its stages (its ends of transfers, the runtime's own work):
    # on its first visit; a device with no stage (the ingress that only sends) is visited first
    for station, ms in demand.items():
        item, batch = _per_batch(ms, demand1[station], size)
        rest = item - placed.get(station, 0.0)
        if rest <= 1e-12 and batch <= 1e-12:
            continue
        rest = max(0.0, rest)
        at = next((i for i, v in enumerate(visits) if v.station == station), None)
        if at is None:
            where = 0 if station == plan.ingress else len(visits)
            visits.insert(where, Visit(station, rest, 0.0, batch))
        else:
            v = visits[at]
            visits[at] = replace(v, ms=v.ms + rest, batch_ms=v.batch_ms + batch)
    return Route(tuple(v for v in visits if v.ms > 0 or v.batch_ms > 0), delay)


def plan_of(pipeline: Pipeline, topology: Any, profiles: tuple[str, ...], policy: str) -> Plan:
    """The plan a policy runs: all-host (every node on the host), the planner's for throughput,
    with host assist weighed, or for the least host CPU."""
    from nicoffload.planner import plan_for, plan_placement

    prof = list(profiles) or None
    if policy == "all-host":
        if HOST not in topology.ids:
            raise PlanError(f"policy 'all-host': topology '{topology.name}' has no '{HOST}'")
        return plan_placement(pipeline, {n.name: HOST for n in pipeline.nodes}, topology, prof)
    if policy == "planner":
        return plan_for(pipeline, topology, prof)
    if policy == "planner+assist":
        return plan_for(pipeline, topology, prof, host_assist=True)
    if policy == "min-host-cpu":
        return plan_for(pipeline, topology, prof, objective="host-cpu")
    raise PlanError(f"unknown policy '{policy}' (expected one of: {', '.join(POLICIES)})")


def stream_model(
    pipeline: Pipeline, topology: Any, profiles: tuple[str, ...], policy: str
) -> StreamModel:
    """The model of `pipeline` on one server of `topology` under `policy`."""
    from nicoffload.planner.cost import Catalog, build_model
    from nicoffload.planner.solve import resolve_profiles

    plan = plan_of(pipeline, topology, profiles, policy)
    priced = resolve_profiles(topology, list(profiles) or None)
    catalog = Catalog.from_registry()
    model = build_model(pipeline, topology, priced, catalog)
    single = build_model(replace(pipeline, batch_max_size=1), topology, priced, catalog)
    size = pipeline.batch_max_size

    def placed(p: Plan) -> np.ndarray:
        return np.array([model.devices.index(p.placement[n]) for n in model.nodes], np.intp)

    assist_route = assist_station = None
    share = 0.0
    if any("host_share" in p for p in plan.physical.values()):
        host = plan_of(pipeline, topology, profiles, "all-host")
        assist_route = _route(host, model, single, placed(host), size)
        assist_station = plan.stages[0].device
        share = float(plan.physical[plan.stages[0].name]["host_share"])
    assert plan.predicted is not None
    return StreamModel(
        pipeline.name,
        policy,
        _route(plan, model, single, placed(plan), size),
        size,
        pipeline.batch_max_wait_ms,
        plan.predicted.host_cpu_ms_per_item,
        plan.predicted,
        dict(plan.placement),
        assist_route,
        assist_station,
        {k: float(c) for k, c in zip(model.resources, model.divisor, strict=True)},
        frozenset(d for d, h in zip(model.devices, model.host, strict=True) if h),
        share,
    )
