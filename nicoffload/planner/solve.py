"""plan_for: the planner's entry point. Resolves the topology and profiles, applies the pipeline's
pins, solves exactly (DP for chains, MILP for DAGs) and builds the Plan the runtime executes.

When nothing is feasible it says why, naming the node (or the SLO) and where it is written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import Mark, PlanError
from nicoffload.graph import Pipeline
from nicoffload.planner import assist
from nicoffload.planner.build import make_plan
from nicoffload.planner.cost import Catalog, CostModel, build_model
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import OBJECTIVE, OBJECTIVES, REL_TOL, Goal, evaluate
from nicoffload.planner.plan import Plan
from nicoffload.planner.runner_up import INFEASIBLE, runner_up, search_runner_up
from nicoffload.profiles import Profile, load_profile
from nicoffload.topology import Topology, load_topology, local_topology

ProfileArg = str | Path | Profile | Sequence[str | Path | Profile] | None
__all__ = ["INFEASIBLE", "plan_for", "plan_placement", "runner_up", "solve"]


def solve(
    model: CostModel,
    goal: Goal,
    allowed: np.ndarray | None = None,
    exclude=None,
    time_limit: float = 60.0,
):
    """The best placement (device index per node) or None; DP for chains, else the MILP."""
    if exclude is None and is_chain(model):
        return solve_chain(model, goal, allowed)
    from nicoffload.planner.milp import solve_milp

    return solve_milp(model, goal, allowed, exclude, time_limit).placement


def resolve_topology(topology: Topology | str | Path | None) -> Topology:
    if topology is None:
        return local_topology()
    return topology if isinstance(topology, Topology) else load_topology(topology)


def resolve_profiles(topology: Topology, profile: ProfileArg = None) -> dict[str, Profile]:
    """Each device's profile: one given for its kind (`--profile`), else the topology's."""
    given = (
        []
        if profile is None
        else [profile]
        if isinstance(profile, (str, Path, Profile))
        else list(profile)
    )
    by_kind: dict[str, Profile] = {}
    for p in given:
        p = p if isinstance(p, Profile) else load_profile(p)
        by_kind[p.kind] = p
    from nicoffload.profiles import default_profile_for

    cache: dict[str, Profile] = {}
    out = {}
    for dev in topology.devices:
        if dev.kind in by_kind:
            out[dev.id] = by_kind[dev.kind]
        elif dev.emulated and "cpu" in by_kind:  # an emulated DPU runs on the host's cores
            out[dev.id] = by_kind["cpu"]
        else:
            path = dev.profile or default_profile_for(dev.kind)
            if path not in cache:
                cache[path] = load_profile(path)
            out[dev.id] = cache[path]
    return out


def _file_marks(pipeline: Pipeline) -> tuple[dict[str, Mark], dict[str, Mark]]:
    """Marks of `placement` entries and `slo` values in the pipeline file (where they exist)."""
    from nicoffload.yamlmarks import MMap, read_marked

    try:
        doc = read_marked(pipeline.path)
    except Exception:
        return {}, {}
    pins, slo = {}, {}
    if isinstance(doc, MMap) and isinstance(doc.get("placement"), MMap):
        pins = {str(k): doc["placement"].value_marks[k] for k in doc["placement"]}
    if isinstance(doc, MMap) and isinstance(doc.get("slo"), MMap):
        slo = {str(k): doc["slo"].value_marks[k] for k in doc["slo"]}
    return pins, slo


def _pinned(entry: str, topology: Topology) -> list[int]:
    kind, _, which = entry.partition(":")
    return [
        i
        for i, d in enumerate(topology.devices)
        if d.kind == kind and (not which or d.id in (which, f"{kind}{which}"))
    ]


def allowed_mask(pipeline: Pipeline, topology: Topology, model: CostModel) -> np.ndarray:
    """Kernels, profiles and pins together; a node left with no device is a PlanError."""
    pin_marks, _ = _file_marks(pipeline)
    allowed = model.allowed.copy()
    for v, node in enumerate(pipeline.nodes):
        mark = pin_marks.get(node.name, node.mark)
        pins = pipeline.placement.get(node.name)
        if pins:
            keep = sorted({d for entry in pins for d in _pinned(entry, topology)})
            if not keep:
                raise PlanError(
                    f"node '{node.name}' is pinned to {', '.join(pins)}, but topology "
                    f"'{topology.name}' has no such device (devices: {', '.join(topology.ids)})",
                    mark,
                )
            pin_mask = np.zeros(len(topology.ids), bool)
            pin_mask[keep] = True
            allowed[v] &= pin_mask
        else:
            keep = list(range(len(topology.ids)))
        if not allowed[v].any():
            reasons = "; ".join(
                f"{topology.ids[d]}: {model.why_not.get((v, d), 'not allowed')}" for d in keep
            )
            pinned = f" is pinned to {', '.join(pins)}, but" if pins else " cannot run anywhere:"
            raise PlanError(f"node '{node.name}'{pinned} {reasons}", mark)
        fits = allowed[v] & (model.mem[v] <= model.mem_cap)
        if not fits.any():
            raise PlanError(
                f"node '{node.name}' needs {model.mem[v] / 2**20:.0f} MiB of batch buffers "
                f"(batch {pipeline.batch_max_size} x 2 slots), more than any device it may use has",
                mark,
            )
    return allowed


def _diagnose(
    pipeline: Pipeline, model: CostModel, goal: Goal, allowed: np.ndarray, cli: bool
) -> PlanError:
    """Why no placement meets the SLO: the best each constraint alone allows, and its worst node."""
    _, slo_marks = _file_marks(pipeline)
    parts, mark = [], None
    for objective, limit, key, flag in (
        ("latency", goal.max_latency_ms, "latency_ms", "--max-latency-ms"),
        ("throughput", goal.min_throughput_per_s, "throughput_per_s", "--min-throughput"),
    ):
        if limit is None:
            continue
        best = solve(model, Goal(objective), allowed)
        m = evaluate(model, best[None, :]) if best is not None else None
        where = flag if cli or key not in slo_marks else f"slo.{key}"
        if objective == "latency" and m is not None and m.latency[0] > limit:
            worst = int(np.argmax(model.cost[np.arange(model.n), best]))
            parts.append(
                f"no placement meets the latency SLO of {limit:g} ms ({where}): the fastest takes "
                f"{m.latency[0]:.3f} ms, most of it node '{model.nodes[worst]}' "
                f"({model.cost[worst, best[worst]]:.3f} ms on {model.devices[best[worst]]})"
            )
            mark = mark or (None if cli else slo_marks.get(key))
        if objective == "throughput" and m is not None and 1e3 / m.bottleneck[0] < limit:
            k = int(np.argmax(m.load[0]))
            on_k = [v for v in range(model.n) if best[v] == k]
            worst = max(on_k, key=lambda v: model.cost[v, k]) if on_k else None
            who = f", most of it node '{model.nodes[worst]}'" if worst is not None else ""
            parts.append(
                f"no placement reaches {limit:g} items/s ({where}): the best reaches "
                f"{1e3 / m.bottleneck[0]:.0f}/s, limited by {model.resources[k]}{who}"
            )
            mark = mark or (None if cli else slo_marks.get(key))
    if not parts:
        parts.append(
            f"no placement meets the latency SLO ({goal.max_latency_ms} ms) and the throughput "
            f"floor ({goal.min_throughput_per_s}/s) together; relax one of them"
        )
    return PlanError("; ".join(parts), mark)


def _milp_notes(result: Any, time_limit_s: float, objective: str) -> tuple[str, ...]:
    """What a plan says of a MILP search its time limit cut short (nothing if it was not)."""
    if result.placement is None:
        return ()
    if result.gap > 1e-6:
        proven = (
            f": this plan is proven within {result.gap:.1%} of the optimum, not optimal"
            if result.gap < 1
            else " before it proved any bound: this plan is not shown to be near the optimum"
        )
        return (f"the MILP stopped at its {time_limit_s:g} s time limit{proven}",)
    if result.tie_gap > 1e-6:
        proven = (
            f"is proven only within {result.tie_gap:.1%} of the best"
            if np.isfinite(result.tie_gap)
            else "was not compared"
        )
        return (
            f"the MILP stopped at its {time_limit_s:g} s time limit: the plan's {objective} "
            f"is optimal, but among plans that tie on it its {OBJECTIVE[objective].tie_break} {proven}",
        )
    if result.cut:
        return (
            f"the MILP reached its {time_limit_s:g} s time limit: this plan is proven "
            "optimal, but among placements that tie with it another run may return another",
        )
    return ()


def plan_for(
    pipeline: Pipeline,
    topology: Topology | str | Path | None = None,
    profile: ProfileArg = None,
    objective: str = "throughput",
    *,
    min_throughput_per_s: float | None = None,
    max_latency_ms: float | None = None,
    explain: bool = False,
    catalog: Catalog | None = None,
    time_limit_s: float = 20.0,
    runnable: bool = False,
    host_assist: bool = False,
) -> Plan:
    """The best Plan for `pipeline` on `topology` (the local machine when None).

    Constraints given here override the pipeline's `slo`. `explain=True` adds per-resource
    loads, the latency path and the runner-up placement (with why it lost) to `plan.explain`.
    `time_limit_s` bounds the search: the plan, then the runner-up in what is left (reading the
    files, building the model and importing the solver come before it). A DAG's MILP that
    reaches it returns its best plan with a note giving the proven gap.
    Every other limit of the search is a count of work, so the same inputs give the same plan
    on an idle and on a loaded machine unless the time limit is reached, which the plan then
    says (`plan.search["stopped_at_time_limit"]`, and a note). The plan holds no clock reading.
    The runtime runs every placement, so every plan is the best overall. `runnable` is accepted
    and ignored (it asked for the best plan of the shapes the runtime used to run; a no-op for
    one release, then removed). `host_assist`: for the throughput objective, also weigh the
    plan with its leading nodes on each DPU and the host taking a share of their items while
    the agent is busy (`planner.assist`), and take it where it is predicted faster.
    """
    if objective not in OBJECTIVES:
        raise PlanError(
            f"unknown objective '{objective}' (expected one of: {', '.join(OBJECTIVES)})"
        )
    topo = resolve_topology(topology)
    profiles = resolve_profiles(topo, profile)
    model = build_model(pipeline, topo, profiles, catalog or Catalog.from_registry())
    chain = is_chain(model)
    if not chain:
        import scipy.optimize  # noqa: F401  (0.7 s here: before the clock, not out of the search's)
    start = time.perf_counter()
    deadline = start + time_limit_s

    def left() -> float:
        return max(0.0, deadline - time.perf_counter())

    cli = min_throughput_per_s is not None or max_latency_ms is not None
    goal = Goal(
        objective,
        min_throughput_per_s if min_throughput_per_s is not None else pipeline.slo_throughput_per_s,
        max_latency_ms if max_latency_ms is not None else pipeline.slo_latency_ms,
    )
    allowed = allowed_mask(pipeline, topo, model)
    notes = profile_notes(profiles)
    timed_out = cut = False
    solves = 0
    gaps: tuple[float, float] = (0.0, 0.0)  # proven: the objective's, its tie-break's

    def search(goal: Goal) -> tuple[np.ndarray | None, tuple[str, ...]]:
        """The best placement for `goal` and the notes of a MILP cut short."""
        nonlocal timed_out, cut, solves, gaps
        if chain:
            return solve_chain(model, goal, allowed), ()
        from nicoffload.planner.milp import solve_milp

        result = solve_milp(model, goal, allowed, time_limit=left())
        cut, solves = result.cut, solves + result.solves
        timed_out = result.placement is None and result.status != "infeasible"
        gaps = (result.gap, result.tie_gap)
        return result.placement, _milp_notes(result, time_limit_s, goal.objective)

    best, said = search(goal)
    floored = None  # the goal whose throughput floor only an assisted plan may meet
    if (
        best is None
        and not timed_out
        and host_assist
        and goal.objective == "throughput"
        and goal.min_throughput_per_s
    ):  # no plain placement reaches the floor: search without it, then weigh host assist
        floored, goal = goal, replace(goal, min_throughput_per_s=None)
        best, said = search(goal)
    notes += said
    if best is None and timed_out:
        raise PlanError(  # out of time, not a proof that nothing fits
            f"the MILP found no placement in its {time_limit_s:g} s time limit "
            f"({len(model.nodes)} nodes on {len(model.devices)} devices): give it more "
            "(--time-limit)"
        )
    if best is None:
        raise _diagnose(pipeline, model, floored or goal, allowed, cli)
    plan = replace(make_plan(pipeline, topo, model, goal, best), notes=notes)
    plain = best
    pick = None
    if host_assist:
        pick = assist.choose(model, goal, allowed, best, plan.predicted.throughput_per_s)
    if floored is not None:  # the plain best misses the floor: an assisted plan must meet it
        floor = floored.min_throughput_per_s * (1 - REL_TOL)
        if pick is None or pick.throughput_per_s < floor:
            raise _diagnose(pipeline, model, floored, allowed, cli)
        goal = floored
    if pick is not None and (
        helped := assist.assisted_plan(pipeline, topo, model, goal, pick, plan)
    ):
        plan, best = helped, pick.placement
    runner_cut = False
    if explain:
        from nicoffload.planner.explain import explanation

        proven = not chain and max(gaps) <= 1e-6 and not cut
        if best is not plain:  # the runner-up: the best plan without host assist
            second, missing = plain, None
        else:
            second, missing, runner_cut = search_runner_up(
                model, goal, best, allowed, left(), proven
            )
        if runner_cut and second is not None:
            plan = replace(
                plan,
                notes=(
                    *plan.notes,
                    f"the runner-up's search reached the {time_limit_s:g} s time limit: it is "
                    "the best other placement found, not proven the best",
                ),
            )
        why = explanation(model, topo, goal, best, second, missing)
        if best is not plain:  # the runner-up lost on the assisted throughput
            why = assist.explain_runner_up(why, plan)
        plan = replace(plan, explain=why)
    record = _search_record(chain, gaps, time_limit_s, solves, cut, runner_cut)
    if best is not plain:  # how the assisted plan was chosen: not by the proven search
        record["host_assist_weighed"] = len(assist.candidates(model, allowed, plain))
    return replace(plan, search=record)


def plan_placement(
    pipeline: Pipeline,
    placement: dict[str, str],
    topology: Topology | str | Path | None = None,
    profile: ProfileArg = None,
    catalog: Catalog | None = None,
    *,
    host_assist: bool = False,
) -> Plan:
    """The Plan of a placement chosen by hand (node -> device id), priced by the model as the
    planner prices its own: what a pinned run is predicted to do. `host_assist`: the host
    also runs its leading DPU stage for a share of the items while the agent is busy (`planner.assist`;
    PlanError for a placement without one)."""
    topo = resolve_topology(topology)
    model = build_model(
        pipeline, topo, resolve_profiles(topo, profile), catalog or Catalog.from_registry()
    )
    unknown = sorted(set(placement.values()) - set(model.devices))
    if unknown or set(placement) != set(model.nodes):
        raise PlanError(
            f"the placement must name every node ({', '.join(model.nodes)}) on a device of "
            f"topology '{topo.name}' ({', '.join(model.devices)})"
        )
    best = np.array([model.devices.index(placement[n]) for n in model.nodes], dtype=np.intp)
    if not np.isfinite(model.cost[np.arange(model.n), best]).all():
        bad = next(n for i, n in enumerate(model.nodes) if not np.isfinite(model.cost[i, best[i]]))
        raise PlanError(f"node '{bad}' cannot run on '{placement[bad]}'")
    notes = profile_notes(resolve_profiles(topo, profile))
    plan = replace(make_plan(pipeline, topo, model, Goal("throughput"), best), notes=notes)
    if host_assist:
        pick = assist.assisted(model, best)
        helped = pick and assist.assisted_plan(
            pipeline, topo, model, Goal("throughput"), pick, plan
        )
        if not helped or pick is None:
            raise PlanError(
                "host assist needs a placement whose first stage is a DPU stage the host can "
                "also run, followed by host stages and at most one GPU stage"
            )
        if pick.host_share < assist.SHARE_MIN:
            raise PlanError(
                f"host assist would take {pick.host_share:.1%} of the items: the host has no "
                "room beside this placement's own work on it (its figures are the same without)"
            )
        plan = helped
    return replace(plan, objective="pinned")


def _search_record(
    chain: bool,
    gaps: tuple[float, float],
    time_limit_s: float,
    solves: int,
    cut: bool,
    runner_cut: bool,
) -> dict:
    """Plan.search: how the placement was found and what is proven of it. No clock reading:
    the same inputs give the same record (`nicoffload plan` reports the seconds it took)."""

    def proven(gap: float) -> float | None:  # a gap of 1 or more bounds nothing
        return round(float(gap), 6) if gap < 1 else None

    method = "dynamic programming" if chain else "MILP (scipy.optimize.milp, HiGHS)"
    return {
        "method": method,
        "time_limit_s": time_limit_s,
        "gap": proven(gaps[0]),
        "tie_break_gap": proven(gaps[1]) if gaps[0] <= 1e-6 else None,
        "solves": solves,  # HiGHS calls: the work the search did
        "stopped_at_time_limit": cut,  # the plan's search (the gaps say what is still proven)
        "runner_up_stopped_at_time_limit": runner_cut,
    }


def profile_notes(profiles: dict[str, Profile]) -> tuple[str, ...]:
    """Which profile priced each device, and whether it was measured or is an estimate: one
    note per profile, naming the devices it priced."""
    by: dict[str, list[str]] = {}
    for dev, p in profiles.items():
        how = p.method.split(":", 1)[0] or "unknown method"
        what = f"profile {Path(p.source).name} ({how}{', ' + p.date if p.date else ''})"
        by.setdefault(what, []).append(dev)
    return tuple(f"{', '.join(devs)}: {what}" for what, devs in by.items())
