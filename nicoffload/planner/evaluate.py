"""What a placement costs under the model: loads, throughput, latency, host CPU; and the goal.

`evaluate` works on many placements at once (rows of device indices); brute force, the tests and
explain all judge placements through it, so every solver answers to one definition.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.fusion import applied

REL_TOL = 1e-7


@dataclass(frozen=True)
class Objective:
    """What an objective minimizes, and what breaks its ties: each a Metrics field
    ("bottleneck", "latency", "host"). Every solver and explain read them from here."""

    name: str
    primary: str
    secondary: str

    @property
    def tie_break(self) -> str:
        """The secondary as an objective's name, as plans and notes say it."""
        return NAMES[self.secondary]


NAMES = {"bottleneck": "throughput", "latency": "latency", "host": "host-cpu"}
OBJECTIVE = {
    o.name: o
    for o in (
        Objective("throughput", "bottleneck", "latency"),
        Objective("latency", "latency", "bottleneck"),
        Objective("host-cpu", "host", "bottleneck"),
    )
}
OBJECTIVES = tuple(OBJECTIVE)


@dataclass(frozen=True)
class Goal:
    """The objective, and the constraints every objective honours when they are given."""

    objective: str = "throughput"
    min_throughput_per_s: float | None = None
    max_latency_ms: float | None = None

    @property
    def max_load_ms(self) -> float:
        return 1e3 / self.min_throughput_per_s if self.min_throughput_per_s else np.inf

    @property
    def latency_cap(self) -> float:
        return self.max_latency_ms if self.max_latency_ms is not None else np.inf


@dataclass(frozen=True)
class Metrics:
    """Per placement (row): work (core-ms or link-ms per item) and load of each resource, etc."""

    work: np.ndarray  # (M, R)
    load: np.ndarray  # (M, R) work / divisor: ms of the resource per item
    bottleneck: np.ndarray  # (M,) ms per item of the busiest resource, `serial` included
    latency: np.ndarray  # (M,) ms per item, critical path with transfers
    host: np.ndarray  # (M,) host CPU ms per item
    memory: np.ndarray  # (M, D) bytes
    ok: np.ndarray  # (M,) every node on an allowed device, memory fits
    # (M,) ms per item the host process's interpreter is held by the host stages (one Python
    # process runs them all: a serial resource, not one per core; `CostModel.serial`)
    serial: np.ndarray

    def keys(self, objective: str) -> tuple[np.ndarray, np.ndarray]:
        """(primary, secondary) per row; lower is better."""
        o = OBJECTIVE[objective]
        return getattr(self, o.primary), getattr(self, o.secondary)

    def feasible(self, goal: Goal) -> np.ndarray:
        slack = 1 + REL_TOL
        return (
            self.ok
            & (self.bottleneck <= goal.max_load_ms * slack)
            & (self.latency <= goal.latency_cap * slack)
        )


def evaluate(model: CostModel, placements: np.ndarray) -> Metrics:
    """Metrics of each row of `placements` ((M, n) device indices, in model.nodes order)."""
    P = np.atleast_2d(np.asarray(placements, dtype=np.intp))
    M, n = P.shape
    rows = np.arange(M)
    work = np.zeros((M, len(model.resources)))
    node_ms = np.empty((M, n))
    for v in range(n):
        node_ms[:, v] = model.cost[v, P[:, v]]
        # one entry per row: a fancy += is np.add.at here, without its cost
        work[rows, P[:, v]] += np.where(np.isfinite(node_ms[:, v]), node_ms[:, v], 0.0)
    for v, d, k, ms in model.side:  # what a node on d costs elsewhere (`planner.side`)
        work[P[:, v] == d, k] += ms
    fused = applied(model, P)
    for k, g in enumerate(model.groups):
        dev = P[:, g.nodes[0]]
        delta = np.where(fused[:, k], np.nan_to_num(g.delta[dev], nan=0.0), 0.0)
        work[rows, dev] += delta
        node_ms[:, g.nodes[-1]] += delta
    finish = np.zeros((M, n))
    ready = np.zeros((M, n))
    latency = np.zeros(M)
    egress = np.full(M, model.egress)
    for r in model.refs:
        src = P[:, r.src] if r.src >= 0 else np.full(M, model.ingress)
        dest = np.zeros((M, len(model.devices)), dtype=bool)
        for c in r.consumers:
            dest[rows, P[:, c]] = True
        if r.output:
            dest[:, model.egress] = True
        dest[rows, src] = False
        work += _sent(model.ref_load(r), src, dest)
    for v in range(n):
        for r in model.refs:
            if v in r.consumers:
                src = P[:, r.src] if r.src >= 0 else np.full(M, model.ingress)
                start = finish[:, r.src] if r.src >= 0 else 0.0
                arrive = start + _route_time(model, r.nbytes, src, P[:, v])
                ready[:, v] = np.maximum(ready[:, v], arrive)
        finish[:, v] = ready[:, v] + node_ms[:, v]
    for r in model.refs:
        if r.output and r.src >= 0:
            done = finish[:, r.src] + _route_time(model, r.nbytes, P[:, r.src], egress)
            latency = np.maximum(latency, done)
    memory = np.zeros((M, len(model.devices)))
    for v in range(n):
        memory[rows, P[:, v]] += model.mem[v]
    ok = np.all(np.isfinite(node_ms), axis=1) & np.all(memory <= model.mem_cap, axis=1)
    load = work / model.divisor
    serial = serial_load(model, P)
    return Metrics(
        work,
        load,
        np.maximum(load.max(axis=1), serial),
        latency,
        work[:, : len(model.devices)][:, model.host].sum(axis=1),
        memory,
        ok,
        serial,
    )


def stage_starts(placements: np.ndarray) -> np.ndarray:
    """(M, n) whether node v starts a stage: runs of nodes on one device in topological order,
    as `plan.stages_for` cuts them."""
    P = np.atleast_2d(placements)
    starts = np.ones(P.shape, dtype=bool)
    starts[:, 1:] = P[:, 1:] != P[:, :-1]
    return starts


def fast_path(model: CostModel, placements: np.ndarray) -> np.ndarray:
    """(M,) whether the runtime's fast path runs each placement (`runtime.chain.fast_path`:
    [a DPU stage] -> host CPU stages -> [a GPU stage]); the general path runs the others."""
    P = np.atleast_2d(placements)
    if not model.kinds:
        return np.ones(len(P), dtype=bool)
    kinds = np.array(model.kinds)
    starts = stage_starts(P)
    n = P.shape[1]
    last = n - 1 - np.argmax(starts[:, ::-1], axis=1)  # where the last stage starts
    at = np.arange(n)
    k = kinds[P]
    fits = (k == "cpu") | ((k == "dpu") & (at == 0)) | ((k == "gpu") & (at == last[:, None]))
    return np.all(fits | ~starts, axis=1)


def serial_load(model: CostModel, placements: np.ndarray) -> np.ndarray:
    """(M,) ms per item of the host process's interpreter: `model.serial` of each stage's
    device on the path that runs the placement, summed over its stages."""
    P = np.atleast_2d(placements)
    if model.serial is None or not P.shape[1]:
        return np.zeros(len(P))
    path = np.where(fast_path(model, P), 0, 1)
    return (model.serial[path[:, None], P] * stage_starts(P)).sum(axis=1)


def figures(model: CostModel, m: Metrics, row: int = 0) -> dict[str, float]:
    """A placement's predicted latency, throughput and host CPU: its metrics plus the host
    runtime's own load per item (`CostModel.base`), the same for every placement; throughput is
    capped by the host process's interpreter too (`Metrics.serial`: the runtime's own serial
    work is in that figure, measured with it)."""
    base = model.base if model.base is not None else np.zeros(len(model.resources))
    bottleneck = max(float(((m.work[row] + base) / model.divisor).max()), float(m.serial[row]))
    D = len(model.devices)
    return {
        "latency_ms": round(float(m.latency[row]), 6),
        "throughput_per_s": round(1e3 / bottleneck, 3) if bottleneck > 0 else 1e12,
        "host_cpu_ms_per_item": round(float(m.host[row] + base[:D][model.host].sum()), 6),
    }


MANY = 64  # rows from which _sent sums over destinations alone


def _sent(load: np.ndarray, src: np.ndarray, dest: np.ndarray) -> np.ndarray:
    """(M, R) what each row's tensor puts on the resources, sent from src to its dest devices:
    einsum("md,mdr->mr", dest, load[src]). Where no row sends to more than two devices, summed
    over those alone: the same figures to the bit (the other terms are zeros, and two terms
    add alike in either order) at a fraction of the cost (the (M, D, R) array einsum reads was
    0.09 of 0.14 s evaluating the 845 neighbours of the 50-node bench's plan). Not for a few
    rows, where einsum's read is small and checking `load` is not (explain's scans evaluate
    one placement at a time)."""
    if len(dest) < MANY or dest.sum(axis=1).max() > 2 or not np.isfinite(load).all():
        return np.einsum("md,mdr->mr", dest, load[src])
    m, d = np.nonzero(dest)  # row by row, devices ascending: a row's second right after
    sent = load[src[m], d]
    first = np.ones(len(m), bool)
    first[1:] = m[1:] != m[:-1]
    out = np.zeros((len(dest), load.shape[2]))
    out[m[first]] += sent[first]  # unique rows in each: as np.add.at, without its cost
    out[m[~first]] += sent[~first]
    return out


def _route_time(model: CostModel, nbytes: float, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    return model.route_ms[src, dst] + nbytes * model.route_ms_per_byte[src, dst]


def best_row(metrics: Metrics, goal: Goal) -> int | None:
    """The best feasible row: least primary key, ties (within REL_TOL) broken by the secondary."""
    feasible = np.flatnonzero(metrics.feasible(goal))
    if not len(feasible):
        return None
    primary, secondary = (k[feasible] for k in metrics.keys(goal.objective))
    low = primary.min()
    tied = primary <= low + abs(low) * REL_TOL + 1e-12  # abs: a key may be below zero
    return int(feasible[tied][np.argmin(secondary[tied])])


def brute_force(
    model: CostModel, goal: Goal, chunk: int = 1 << 16
) -> tuple[np.ndarray, Metrics] | None:
    """The best placement by exhaustive search (small problems: tests and explain), or None."""
    choices = [np.flatnonzero(model.allowed[v]) for v in range(model.n)]
    if any(len(c) == 0 for c in choices):
        return None
    best: tuple[float, float, np.ndarray] | None = None
    product = itertools.product(*choices)
    while True:
        block = np.array(list(itertools.islice(product, chunk)), dtype=np.intp)
        if not len(block):
            break
        m = evaluate(model, block)
        i = best_row(m, goal)
        if i is not None:
            primary, secondary = (k[i] for k in m.keys(goal.objective))
            if best is None or _better((primary, secondary), best[:2]):
                best = (primary, secondary, block[i])
    if best is None:
        return None
    return best[2], evaluate(model, best[2][None, :])


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    if a[0] < b[0] * (1 - REL_TOL) - 1e-12:
        return True
    return a[0] <= b[0] * (1 + REL_TOL) + 1e-12 and a[1] < b[1] * (1 - REL_TOL) - 1e-12
