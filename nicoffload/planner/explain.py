"""Why a plan is what it is: per-device and per-link load, the host process's serial load, the
bottleneck, the latency path, and the runner-up placement with the reason it lost, as one
JSON-ready dict (`plan --json` "explain").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import OBJECTIVE, REL_TOL, Goal, Metrics, evaluate, figures
from nicoffload.planner.fusion import applied
from nicoffload.planner.sensitivity import sensitivity
from nicoffload.topology import Topology


def _bandwidth(topology: Topology, hop: str) -> float:
    """A hop's bandwidth in its direction (`Link.toward`)."""
    a, b = hop.split("->")
    return next(k.toward(b).bandwidth for k in topology.links if {k.a, k.b} == {a, b})


def resource(model: CostModel, topology: Topology, m: Metrics, k: int) -> dict[str, Any]:
    """One resource's share of the work of one placement (row 0 of `m`)."""
    name = model.resources[k]
    out: dict[str, Any] = {"resource": name, "load_ms_per_item": round(float(m.load[0, k]), 6)}
    if k < len(model.devices):
        out.update(
            kind="device",
            work_core_ms_per_item=round(float(m.work[0, k]), 6),
            capacity=float(model.divisor[k]),
        )
    else:
        bw = _bandwidth(topology, name)
        out.update(
            kind="link",
            bytes_per_item=round(m.work[0, k] * bw / 1e3),
            bandwidth_gbps=round(bw * 8 / 1e9, 3),
        )
    return out


HOST_PROCESS = "host process (one Python interpreter)"


def host_process(m: Metrics) -> dict[str, Any]:
    """The host process's interpreter as a resource of one placement (row 0 of `m`): the
    GIL-held time of its host stages per item, and the items/s that caps."""
    ms = float(m.serial[0])
    return {
        "resource": HOST_PROCESS,
        "kind": "serial",
        "load_ms_per_item": round(ms, 6),
        "items_per_s": round(1e3 / ms, 1) if ms > 0 else None,
    }


def binding(model: CostModel, topology: Topology, m: Metrics) -> dict[str, Any]:
    """The busiest resource of one placement: a device, a link, or the host process when its
    interpreter caps the placement more than any of them does."""
    k = int(np.argmax(m.load[0]))
    if float(m.serial[0]) > float(m.load[0, k]):
        return host_process(m)
    return resource(model, topology, m, k)


def _describe(r: dict[str, Any]) -> str:
    if r["kind"] == "serial":
        return (
            f"{r['resource']}: {r['items_per_s']:.0f} items/s (its host stages hold the GIL "
            f"{r['load_ms_per_item']:.4f} ms/item, one thread at a time whatever the cores)"
        )
    if r["kind"] == "link":
        return (
            f"link {r['resource']} carries {r['bytes_per_item'] / 1e3:.0f} KB/item at "
            f"{r['bandwidth_gbps']:g} Gb/s = {r['load_ms_per_item']:.4f} ms/item"
        )
    return (
        f"device {r['resource']} works {r['work_core_ms_per_item']:.4f} core-ms/item on "
        f"{r['capacity']:g} parallel workers = {r['load_ms_per_item']:.4f} ms/item"
    )


def latency_path(model: CostModel, placement: np.ndarray) -> list[dict[str, Any]]:
    """The critical path of one item: transfers and node times, in order (sums to the latency)."""
    P = placement
    node_ms = model.cost[np.arange(model.n), P].astype(float)
    fused = applied(model, P[None, :])[0]
    for g in (g for g, on in zip(model.groups, fused, strict=True) if on):
        node_ms[g.nodes[-1]] += g.delta[P[g.nodes[0]]]
    finish = np.zeros(model.n)
    came: dict[int, tuple[int, str, float]] = {}
    for v in range(model.n):
        ready, why = 0.0, (-1, "", 0.0)
        for r in model.refs:
            if v in r.consumers:
                s = P[r.src] if r.src >= 0 else model.ingress
                t = model.ref_time(r, s, P[v])
                arrive = (finish[r.src] if r.src >= 0 else 0.0) + t
                if arrive >= ready:
                    ready, why = arrive, (r.src, r.label, t)
        came[v] = why
        finish[v] = ready + node_ms[v]
    end, last, out_t = -1.0, -1, 0.0
    for r in model.refs:
        if r.output and r.src >= 0:
            t = model.ref_time(r, P[r.src], model.egress)
            if finish[r.src] + t > end:
                end, last, out_t, label = finish[r.src] + t, r.src, t, r.label
    steps: list[dict[str, Any]] = []
    if out_t:
        steps.append({"transfer": label, "to": model.devices[model.egress], "ms": round(out_t, 6)})
    v = last
    while v >= 0:
        steps.append(
            {
                "node": model.nodes[v],
                "device": model.devices[P[v]],
                "ms": round(float(node_ms[v]), 6),
            }
        )
        src, label, t = came[v]
        if t:
            steps.append({"transfer": label, "to": model.devices[P[v]], "ms": round(t, 6)})
        v = src
    return _merge_fused(model, P, steps[::-1])


def _merge_fused(
    model: CostModel, P: np.ndarray, steps: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A fused group runs as one kernel: show it as one step."""
    fused = applied(model, P[None, :])[0]
    for g in (g for g, on in zip(model.groups, fused, strict=True) if on):
        d = P[g.nodes[0]]
        names = [model.nodes[v] for v in g.nodes]
        at = [i for i, s in enumerate(steps) if s.get("node") in names]
        if len(at) == len(names):
            merged = {
                "node": "+".join(names),
                "device": model.devices[d],
                "ms": round(sum(steps[i]["ms"] for i in at), 6),
            }
            steps = [*steps[: at[0]], merged, *steps[at[-1] + 1 :]]
    return steps


def why_lost(
    model: CostModel, topology: Topology, goal: Goal, best: Metrics, other: Metrics
) -> dict[str, Any]:
    """Which objective the runner-up lost on and the resource (link bytes or device time) why."""
    p_best, _s_best = (float(k[0]) for k in best.keys(goal.objective))
    p_other, _s_other = (float(k[0]) for k in other.keys(goal.objective))
    tied = p_other <= p_best * (1 + REL_TOL) + 1e-12
    lost_on = OBJECTIVE[goal.objective].tie_break if tied else goal.objective
    out: dict[str, Any] = {"lost_on": lost_on, "tied_on": goal.objective if tied else None}
    if lost_on == "throughput":
        busiest = binding(model, topology, other)
        out["binding"] = busiest
        out["why"] = (
            f"its busiest resource is {busiest['resource']}: {_describe(busiest)}, "
            f"against {float(best.bottleneck[0]):.4f} ms/item for the plan's busiest"
        )
        out["reason"] = {"link": "link bytes", "serial": "host process (GIL)"}.get(
            busiest["kind"], "device time"
        )
    elif lost_on == "latency":
        out["why"] = (
            f"its latency is {float(other.latency[0]):.4f} ms against {float(best.latency[0]):.4f} ms"
        )
        out["reason"] = "latency"
    else:
        out["why"] = (
            f"it takes {float(other.host[0]):.4f} host CPU ms/item against {float(best.host[0]):.4f}"
        )
        out["reason"] = "host cpu"
    return out


def explanation(
    model: CostModel,
    topology: Topology,
    goal: Goal,
    best: np.ndarray,
    second: np.ndarray | None,
    missing: str | None = None,
) -> dict[str, Any]:
    """What `plan --json` puts under "explain"; `missing` says why there is no runner-up."""
    m = evaluate(model, best[None, :])
    used = [i for i in range(len(model.resources)) if m.work[0, i] > 0 or i < len(model.devices)]
    nodes = {}
    for v, name in enumerate(model.nodes):
        options = {
            dev: round(float(model.cost[v, d]), 6)
            if np.isfinite(model.cost[v, d])
            else model.why_not.get((v, d), "not allowed")
            for d, dev in enumerate(model.devices)
        }
        nodes[name] = {
            "device": model.devices[best[v]],
            "work": float(model.work[v]),
            "core_ms_by_device": options,
        }
    out: dict[str, Any] = {
        "objective": goal.objective,
        "constraints": {
            "min_throughput_per_s": goal.min_throughput_per_s,
            "max_latency_ms": goal.max_latency_ms,
        },
        "bottleneck": binding(model, topology, m),
        "bottleneck_why": _describe(binding(model, topology, m)),
        "devices": {
            model.resources[i]: resource(model, topology, m, i)
            for i in used
            if i < len(model.devices)
        },
        "links": {
            model.resources[i]: resource(model, topology, m, i)
            for i in used
            if i >= len(model.devices)
        },
        **({"host_process": host_process(m)} if model.serial is not None else {}),
        "latency_path": latency_path(model, best),
        "nodes": nodes,
        "runner_up": None,
    }
    if second is None and missing:
        out["runner_up_missing"] = missing
    if second is not None:
        o = evaluate(model, second[None, :])
        out["runner_up"] = {
            "placement": {
                name: model.devices[d] for name, d in zip(model.nodes, second, strict=True)
            },
            "differs": {
                name: [model.devices[a], model.devices[b]]
                for name, a, b in zip(model.nodes, best, second, strict=True)
                if a != b
            },
            "predicted": figures(model, o),
            "bottleneck": binding(model, topology, o),
            **why_lost(model, topology, goal, m, o),
            # how firm the choice is: the factor at which the runner-up would win instead
            "would_win_if": sensitivity(model, goal, best, second),
        }
    return out
