"""Fused kernels as the runtime binds them, for the cost model and every solver.

The runtime fuses within a stage only (`runtime.stage.bind_steps`): from the stage's first node
it takes, greedily, the longest fused chain that fits in the stage, else the node alone. Which
windows run fused therefore depends on where the run of nodes on one device starts and ends
(decode and resize on the DPU, crop and normalize on the host fuse `crop+normalize`, a window
the whole-pipeline greedy never sees). Each Group carries that dependence as a table over the
run's start and end, clamped to the segment between cuts (a cut: no window holds both nodes
around it, so every run's greedy passes through it). Pure functions; no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from nicoffload.graph import Node, Pipeline


def _fusable(pipeline: Pipeline, chain: Sequence[Node]) -> bool:
    """Mirrors runtime.stage: inner nodes feed only the next node and are not outputs."""
    outputs = {r.source for r in pipeline.outputs.values()}
    for a, b in itertools.pairwise(chain):
        consumers = pipeline.consumers(a.name)
        if len(a.out_specs) != 1 or a.name in outputs or len(b.inputs) != 1:
            return False
        if len(consumers) != 1 or consumers[0].name != b.name:
            return False
    return True


def windows(pipeline: Pipeline, chains: Iterable[tuple[str, ...]]) -> list[tuple[int, int]]:
    """Every (first, last) node index, in topological order, where one of `chains` matches and
    could be fused: the candidates a stage's greedy chooses among."""
    nodes = list(pipeline.nodes)
    found = []
    for chain in set(chains):
        for i in range(len(nodes) - len(chain) + 1):
            window = nodes[i : i + len(chain)]
            if tuple(n.op for n in window) == chain and _fusable(pipeline, window):
                found.append((i, i + len(chain) - 1))
    return sorted(found)


def cover(found: Iterable[tuple[int, int]], s: int, e: int) -> list[tuple[int, int]]:
    """The fused windows the runtime's greedy takes on a stage of nodes s..e (as bind_steps)."""
    longest: dict[int, list[int]] = {}
    for i, j in found:
        longest.setdefault(i, []).append(j)
    taken, p = [], s
    while p <= e:
        j = max((j for j in longest.get(p, ()) if j <= e), default=p)
        if j > p:
            taken.append((p, j))
        p = j + 1
    return taken


def cuts(n: int, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """(n + 1,) True at u when no window holds both u - 1 and u (and at 0 and n)."""
    out = np.ones(n + 1, dtype=bool)
    for i, j in spans:
        out[i + 1 : j + 1] = False
    return out


def table(found: Sequence[tuple[int, int]], window: tuple[int, int], cut: np.ndarray):
    """(s0, rows): rows[s - s0, e - j] says whether a run of nodes s..e on one device fuses
    `window` = (i, j); s is clamped up to s0 (the cut before i), e down to the cut after j."""
    i, j = window
    s0 = int(np.flatnonzero(cut[: i + 1])[-1])
    e1 = int(np.flatnonzero(cut[j + 1 :])[0]) + j
    rows = np.array(
        [[window in cover(found, s, e) for e in range(j, e1 + 1)] for s in range(s0, i + 1)]
    )
    return s0, rows


def run_bounds(P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of placements (M, n): each node's run (stage) first and last node index."""
    M, n = P.shape
    start, end = np.zeros((M, n), np.intp), np.full((M, n), n - 1, np.intp)
    for v in range(1, n):
        start[:, v] = np.where(P[:, v] == P[:, v - 1], start[:, v - 1], v)
    for v in range(n - 2, -1, -1):
        end[:, v] = np.where(P[:, v] == P[:, v + 1], end[:, v + 1], v)
    return start, end


def applied(model, P: np.ndarray) -> np.ndarray:
    """(M, G): group g runs fused in placement row m (its nodes on one device that has the
    fused kernel, delta not nan, and the greedy cover of their run takes it)."""
    P = np.atleast_2d(P)
    start, end = run_bounds(P)
    out = np.zeros((len(P), len(model.groups)), dtype=bool)
    for k, g in enumerate(model.groups):
        dev = P[:, g.nodes[0]]
        same = np.all(P[:, list(g.nodes)] == dev[:, None], axis=1) & np.isfinite(g.delta[dev])
        out[:, k] = same & g.applies(start[:, g.nodes[0]], end[:, g.nodes[-1]])
    return out


def steps(model, placement: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
    """The kernels the model prices for one placement, in order: (node indices, device)."""
    P = np.asarray(placement, dtype=np.intp)
    fused = {model.groups[k].nodes: k for k in np.flatnonzero(applied(model, P[None, :])[0])}
    out, v = [], 0
    while v < model.n:
        chain = next((c for c in fused if c[0] == v), (v,))
        out.append((chain, int(P[v])))
        v = chain[-1] + 1
    return out


def settle_table(model) -> np.ndarray:
    """(n, n, D): the fused deltas of a run's part s..e on device d, for s..e within one
    segment between cuts (where the chain solvers ask: they add a run's deltas part by part,
    each once its end is known). Zero where nothing fuses."""
    n, D = model.n, len(model.devices)
    cut = group_cuts(model)
    out = np.zeros((n, n, D))
    for g in model.groups:
        i, j = g.nodes[0], g.nodes[-1]
        a, b = int(np.flatnonzero(cut[: i + 1])[-1]), int(np.flatnonzero(cut[j + 1 :])[0]) + j
        hit = g.applies(np.arange(a, i + 1)[:, None], np.arange(j, b + 1)[None, :])
        hit = np.broadcast_to(hit, (i + 1 - a, b + 1 - j))
        out[a : i + 1, j : b + 1, :] += hit[..., None] * np.nan_to_num(g.delta, nan=0.0)
    return out


def group_cuts(model) -> np.ndarray:
    """(n + 1,) the cuts of the model's groups (`cuts`)."""
    return cuts(model.n, ((g.nodes[0], g.nodes[-1]) for g in model.groups))
