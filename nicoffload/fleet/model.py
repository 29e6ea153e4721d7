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
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import PlanError
from nicoffload.graph import Pipeline
from nicoffload.planner.plan import Plan, Predicted

HOST = "cpu"  # the host device of a topology (`planner.assist.HOST`)
POLICIES = ("all-host", "planner", "planner+assist", "min-host-cpu")


@dataclass(frozen=True)
class Visit:
    """An item's service at one station: `ms` on one of its servers, of which `serial_ms`
    with the host process's interpreter held (a host stage's GIL-held part)."""

    station: str
    ms: float
    serial_ms: float = 0.0


@dataclass(frozen=True)
class Route:
    visits: tuple[Visit, ...]
    delay_ms: float  # propagation on the links, no queue

    @property
    def ms(self) -> float:
        return sum(v.ms for v in self.visits) + self.delay_ms


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
    # host assist: a batch takes the host's copy of the pipeline (`assist_route`) when the
    # agent's station (`assist_station`) already holds a batch's items (`runtime.assist`)
    assist_route: Route | None = None
    assist_station: str | None = None
    # station -> its parallel servers (a device's capacity; a link's hop: 1), and which are
    # the host's CPU
    capacity: dict[str, float] | None = None
    host: frozenset[str] = frozenset()


def _route(plan: Plan, model: Any, best: np.ndarray) -> Route:
    """The stations an item of `plan` visits, in order, with their service per item."""
    from nicoffload.planner.evaluate import evaluate, fast_path

    m = evaluate(model, best[None, :])
    base = model.base if model.base is not None else np.zeros(len(model.resources))
    demand = dict(zip(model.resources, m.work[0] + base, strict=True))
    serial_row = (
        model.serial[0 if fast_path(model, best[None, :])[0] else 1]
        if (model.serial is not None)
        else np.zeros(len(model.devices))
    )
    visits: list[Visit] = []
    placed: dict[str, float] = {}  # station -> ms already given to its visits
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
                    visits.append(Visit(hop, float(demand[hop])))
                    placed[hop] = demand[hop]

    hops(t for t in plan.io_transfers if t.src_stage == "ingress")
    for st in plan.stages:
        d = model.devices.index(st.device)
        ms = float(st.predicted_ms_per_item or 0.0)
        serial = float(serial_row[d])
        visits.append(Visit(st.device, ms, min(serial, ms) if model.host[d] else 0.0))
        placed[st.device] = placed.get(st.device, 0.0) + ms
        hops(t for t in plan.transfers if t.src_stage == st.name)
        hops(t for t in plan.io_transfers if t.src_stage == st.name)
    # what a device does besides its stages (its ends of transfers, the runtime's own work):
    # on its first visit; a device with no stage (the ingress that only sends) is visited first
    for station, ms in demand.items():
        rest = ms - placed.get(station, 0.0)
        if rest <= 1e-12:
            continue
        at = next((i for i, v in enumerate(visits) if v.station == station), None)
        if at is None:
            visits.insert(
                0 if station == plan.ingress else len(visits), Visit(station, float(rest))
            )
        else:
            v = visits[at]
            visits[at] = Visit(station, float(v.ms + rest), v.serial_ms)
    return Route(tuple(v for v in visits if v.ms > 0), delay)


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
    model = build_model(
        pipeline,
        topology,
        resolve_profiles(topology, list(profiles) or None),
        Catalog.from_registry(),
    )
    best = np.array([model.devices.index(plan.placement[n]) for n in model.nodes], np.intp)
    assist_route = assist_station = None
    if any("host_share" in p for p in plan.physical.values()):
        host = plan_of(pipeline, topology, profiles, "all-host")
        hbest = np.array([model.devices.index(host.placement[n]) for n in model.nodes], np.intp)
        assist_route = _route(host, model, hbest)
        assist_station = plan.stages[0].device
    assert plan.predicted is not None
    return StreamModel(
        pipeline.name,
        policy,
        _route(plan, model, best),
        pipeline.batch_max_size,
        pipeline.batch_max_wait_ms,
        plan.predicted.host_cpu_ms_per_item,
        plan.predicted,
        dict(plan.placement),
        assist_route,
        assist_station,
        {k: float(c) for k, c in zip(model.resources, model.divisor, strict=True)},
        frozenset(d for d, h in zip(model.devices, model.host, strict=True) if h),
    )
