"""The Plan of one placement: its stages and transfers cut from the placement, each predicted
by the cost model, its input and output transfers, loads and physical decisions. Used by the
planner for its own plans, for pinned ones and for assisted ones (`planner.assist`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from nicoffload.errors import DeviceError
from nicoffload.graph import Pipeline
from nicoffload.planner import physical
from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import Goal, Metrics, evaluate, figures
from nicoffload.planner.fusion import applied
from nicoffload.planner.plan import Plan, Predicted, TransferPlan, stages_for
from nicoffload.topology import Topology


def _route_text(topology: Topology, src: str, dst: str) -> tuple[str, str | None]:
    hops = topology.route(src, dst)
    if not hops:
        return "inproc", None
    return "+".join(h.link.transport for h in hops), "->".join([src] + [h.dst for h in hops])


def make_plan(
    pipeline: Pipeline, topology: Topology, model: CostModel, goal: Goal, best: np.ndarray
) -> Plan:
    """The Plan of one placement, with every stage and transfer predicted by the model."""
    placement = {name: model.devices[d] for name, d in zip(model.nodes, best, strict=True)}
    m: Metrics = evaluate(model, best[None, :])
    stages, transfers = stages_for(pipeline, placement)
    index = {name: i for i, name in enumerate(model.nodes)}
    fused = [g for g, on in zip(model.groups, applied(model, best[None, :])[0], strict=True) if on]
    new_stages = []
    for s in stages:
        d = model.devices.index(s.device)
        members = {index[n] for n in s.nodes}
        ms = sum(model.cost[v, d] for v in members)
        ms += sum(g.delta[d] for g in fused if set(g.nodes) <= members)
        new_stages.append(replace(s, predicted_ms_per_item=round(float(ms), 6)))
    refs = {r.label: r for r in model.refs}
    device_of = {s.name: s.device for s in stages}
    new_transfers = []
    for t in transfers:
        a, b = device_of[t.src_stage], device_of[t.dst_stage]
        transport, link = _route_text(topology, a, b)
        r = refs[t.tensor]
        ms = r and model.ref_time(r, model.devices.index(a), model.devices.index(b))
        new_transfers.append(
            replace(
                t,
                transport=transport,
                link=link,
                bytes_per_item=int(r.nbytes),
                predicted_ms_per_item=round(ms, 6),
            )
        )
    io = []
    stage_of = {n: s for s in stages for n in s.nodes}
    for r in model.refs:
        if r.src < 0:
            for dev in sorted(
                {placement[model.nodes[c]] for c in r.consumers} - {topology.ingress}
            ):
                first = next(
                    stage_of[model.nodes[c]].name
                    for c in r.consumers
                    if placement[model.nodes[c]] == dev
                )
                io.append(_io(topology, model, r, topology.ingress, dev, "ingress", first))
        elif r.output and placement[model.nodes[r.src]] != topology.egress:
            src = placement[model.nodes[r.src]]
            io.append(
                _io(
                    topology,
                    model,
                    r,
                    src,
                    topology.egress,
                    stage_of[model.nodes[r.src]].name,
                    "egress",
                )
            )
    loads = {
        k: round(float(x), 6) for k, x in zip(model.resources, m.load[0], strict=True) if x > 0
    }
    plan = Plan(
        pipeline=pipeline.name,
        placement=placement,
        stages=tuple(new_stages),
        transfers=tuple(new_transfers),
        objective=goal.objective,
        predicted=_predicted(model, m),
        topology=topology.name,
        ingress=topology.ingress,
        egress=topology.egress,
        io_transfers=tuple(io),
        loads=loads,
    )
    try:
        return physical.complete(pipeline, plan, topology)
    except DeviceError as exc:  # the run says so too, before any agent starts
        return replace(plan, notes=(*plan.notes, f"not runnable as it is: {exc}"))


def _predicted(model: CostModel, m: Metrics) -> Predicted:
    return Predicted(**figures(model, m))


def _io(
    topology: Topology, model: CostModel, r, src: str, dst: str, src_stage: str, dst_stage: str
) -> TransferPlan:
    transport, link = _route_text(topology, src, dst)
    ms = model.ref_time(r, model.devices.index(src), model.devices.index(dst))
    return TransferPlan(src_stage, dst_stage, r.label, transport, int(r.nbytes), link, round(ms, 6))
