"""Host assist: the host runs a plan's leading DPU stage for a share of the items while its
agent is busy, so a DPU stage adds the DPU's cores to the host's rather than replacing them.

On a DPU with no more cores than the host gives the pipeline, a plan that moves the heavy
stages to the DPU cannot beat the all-host plan: the agent becomes the bottleneck and the host
waits. With host assist the runtime sends each batch whole to the agent while the agent holds
less than a batch's rows, and once it holds more, runs a share of each batch's rows on the host
(its copy of the DPU stage, as after a failover) as far as the host keeps up
(`runtime.assist`); the run counts the rows so run (`RunStats.assisted`).

Priced as the runtime runs it: the agent's path at its own bottleneck rate x, and the host's
copy of the whole pipeline at whatever rate y every resource still has room for beside x
(host cores, the host process's interpreter, links). Pure functions of the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline
from nicoffload.planner import physical
from nicoffload.planner.build import make_plan
from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import REL_TOL, Goal, evaluate, fast_path, stage_starts
from nicoffload.planner.plan import Plan, Predicted
from nicoffload.topology import Topology

HOST = "cpu"  # the device the runtime runs an assisted (or failed-over) DPU stage on
GAIN = 1.02  # an assisted plan is chosen over the plain best only for more than this
# the shares the runtime's controller keeps to (`runtime.assist`): a plan's share is clamped
# into them, and a placement whose host would take less than SHARE_MIN is not assisted
SHARE_MIN, SHARE_MAX = 0.05, 0.95


@dataclass(frozen=True)
class Assisted:
    """An assisted placement's predicted figures."""

    placement: np.ndarray  # (n,) device per node, the DPU stage first
    throughput_per_s: float
    host_cpu_ms_per_item: float
    latency_ms: float  # the slower of the two paths an item may take
    host_share: float  # of the items, those the host runs the DPU stage for
    agent_per_s: float  # the agent's path alone (x)
    fits: bool  # both paths within every device's memory


def lead(model: CostModel, placement: np.ndarray) -> np.ndarray | None:
    """The nodes of the placement's leading DPU stage, when the runtime's fast path runs it
    ([a DPU stage] -> host -> [a GPU stage]); else None."""
    P = np.asarray(placement)
    if not model.kinds or not len(P) or model.kinds[P[0]] != "dpu":
        return None
    if not fast_path(model, P[None, :])[0]:
        return None
    starts = stage_starts(P[None, :])[0]
    end = int(np.argmax(starts[1:])) + 1 if starts[1:].any() else len(P)
    return np.arange(end)


def assisted(model: CostModel, placement: np.ndarray) -> Assisted | None:
    """The placement's figures with host assist, or None where it has no leading DPU stage
    or the model has no host device the runtime would run that stage on."""
    nodes = lead(model, placement)
    if nodes is None or HOST not in model.devices:
        return None
    host = model.devices.index(HOST)
    P = np.asarray(placement, dtype=np.intp)
    F = P.copy()
    F[nodes] = host
    if not np.isfinite(model.cost[nodes, host]).all():
        return None  # the host cannot run the stage: no failover, no assist
    m = evaluate(model, np.stack([P, F]))
    base = model.base if model.base is not None else np.zeros(len(model.resources))
    load = (m.work + base) / model.divisor  # (2, R) ms of each resource per item
    serial = m.serial
    x = 1.0 / max(float(load[0].max()), float(serial[0]), 1e-12)  # items per ms
    room = [(1.0 - x * load[0, r]) / load[1, r] for r in range(load.shape[1]) if load[1, r] > 0]
    if serial[1] > 0:
        room.append((1.0 - x * serial[0]) / serial[1])
    y = max(0.0, min(room)) if room else 0.0
    D = len(model.devices)
    hb = float(base[:D][model.host].sum())
    hp, hf = float(m.host[0]) + hb, float(m.host[1]) + hb
    return Assisted(
        placement=P,
        throughput_per_s=round(float((x + y) * 1e3), 3),
        host_cpu_ms_per_item=round(float((x * hp + y * hf) / (x + y)), 6),
        latency_ms=round(float(max(m.latency[0], m.latency[1])), 6),
        host_share=round(float(y / (x + y)), 6),
        agent_per_s=round(float(x * 1e3), 3),
        fits=bool(m.ok[0] and m.ok[1]),
    )


def candidates(model: CostModel, allowed: np.ndarray, best: np.ndarray) -> list[np.ndarray]:
    """`best`, and `best` with each leading run of nodes (in topological order) moved onto each
    DPU that may run all of them: the placements host assist is weighed for."""
    out = [np.asarray(best, dtype=np.intp)]
    for d, kind in enumerate(model.kinds):
        if kind != "dpu":
            continue
        for k in range(1, model.n + 1):
            if not allowed[:k, d].all():
                break
            P = out[0].copy()
            P[:k] = d
            if not any(np.array_equal(P, q) for q in out):
                out.append(P)
    return out


def choose(
    model: CostModel, goal: Goal, allowed: np.ndarray, best: np.ndarray, plain_per_s: float
) -> Assisted | None:
    """The assisted placement to run instead of `best` (whose figures give `plain_per_s`), or
    None: for the throughput objective, the candidate with the most throughput that meets the
    goal's latency cap and memory, where it beats the plain best by more than GAIN; ties go
    to the lower latency, then the lower host CPU."""
    if goal.objective != "throughput":
        return None
    found: list[Assisted] = []
    host = model.devices.index(HOST) if HOST in model.devices else -1
    for P in candidates(model, allowed, best):
        a = assisted(model, P)
        if a is None or not a.fits or a.host_share < SHARE_MIN:
            continue
        nodes = lead(model, P)
        assert nodes is not None  # `assisted` found the stage
        if not allowed[nodes, host].all():
            continue  # a pin keeps these nodes off the host: its copy may not run them
        if a.latency_ms > goal.latency_cap * (1 + REL_TOL):
            continue
        found.append(a)
    if not found:
        return None
    pick = max(found, key=lambda a: (a.throughput_per_s, -a.latency_ms, -a.host_cpu_ms_per_item))
    return pick if pick.throughput_per_s > plain_per_s * GAIN else None


def assisted_plan(
    pipeline: Pipeline,
    topology: Topology,
    model: CostModel,
    goal: Goal,
    pick: Assisted,
    plain: Plan,
) -> Plan | None:
    """The plan of an assisted placement (`planner.assist.choose`), predicted as assisted,
    its notes saying so beside the plain best's figures; None where its stage cannot run."""
    plan = make_plan(pipeline, topology, model, goal, pick.placement)
    first = plan.stages[0]
    if first.name not in plan.physical:
        return None
    assert plain.predicted is not None and plan.predicted is not None
    without = plan.predicted
    share = min(SHARE_MAX, max(SHARE_MIN, pick.host_share))
    plan = physical.with_host_share(plan, share)
    note = (
        f"host assist: the host runs stage '{first.name}' ({', '.join(first.nodes)}) for the "
        f"items while its agent is busy (about {pick.host_share:.0%} of them): "
        f"{pick.throughput_per_s:,.0f} items/s predicted, against {without.throughput_per_s:,.0f} "
        f"for this placement without it and {plain.predicted.throughput_per_s:,.0f} for the "
        "best plan without host assist"
    )
    return replace(
        plan,
        notes=(*plain.notes, note),
        predicted=Predicted(
            float(pick.latency_ms), float(pick.throughput_per_s), float(pick.host_cpu_ms_per_item)
        ),
        explain={
            "host_assist": {
                "stage": first.name,
                "host_share": share,  # where the runtime starts (the priced share, clamped)
                "priced_share": pick.host_share,
                "agent_per_s": pick.agent_per_s,
                "throughput_per_s": pick.throughput_per_s,
                "without": {
                    "throughput_per_s": without.throughput_per_s,
                    "host_cpu_ms_per_item": without.host_cpu_ms_per_item,
                },
                "best_without": {
                    "placement": dict(plain.placement),
                    "throughput_per_s": plain.predicted.throughput_per_s,
                    "host_cpu_ms_per_item": plain.predicted.host_cpu_ms_per_item,
                },
            }
        },
    )


def explain_runner_up(why: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """`why` (an explanation whose runner-up is the best plan without host assist) with the
    assisted plan's own figures and the runner-up's loss stated on its assisted throughput."""
    assert plan.predicted is not None
    why["host_assist"] = plan.explain["host_assist"]
    if ru := why.get("runner_up"):
        ru.update(
            lost_on="throughput",
            reason="throughput",
            tied_on=None,
            why=f"its throughput is {ru['predicted']['throughput_per_s']:,.0f} items/s "
            f"against {plan.predicted.throughput_per_s:,.0f} with host assist",
            would_win_if=[],  # the sensitivity scan prices plans without host assist
        )
    return why
