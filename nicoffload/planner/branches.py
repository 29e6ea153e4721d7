"""Parallel branches: a DAG that falls apart into chains (a multi-camera or multimodal request:
per camera decode -> resize -> crop -> normalize, per caption a tokenizer) is planned per class
of identical chains, as integer flows over the chain's (node, device) states.

The copies of one class are interchangeable, so only how many of them take each path matters:
the 40 copies of a branch are one flow of value 40 instead of 40 x 4 binary rows, and branch
symmetry is gone. Any integer flow splits into that many source-to-sink paths (one per copy),
and every load is a sum over arcs, so the flow model is exact for loads, host CPU and memory.
A latency bound is a bound on each path, which a flow cannot see; `bucketed` expands the states
by how much of the bound is left, rounded down to the latencies the rest of the chain can take:
that is exact too (two budgets that admit the same completions are the same state).
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from nicoffload.planner.cost import CostModel
from nicoffload.planner.evaluate import REL_TOL
from nicoffload.planner.fusion import group_cuts, settle_table

MAX_SUFFIXES = 20_000  # distinct completion latencies one state may have before we give up


@dataclass(frozen=True)
class Chains:
    """A class of identical chains and its state graph. State 0 is the source (the ingress),
    the last state the sink (outputs delivered); the others are (position, device, run)."""

    members: tuple[tuple[int, ...], ...]  # node indices of each copy, in chain order
    tail: np.ndarray  # (A,) state an arc leaves
    head: np.ndarray  # (A,) state it enters
    pos: np.ndarray  # (A,) chain position of the head node; k for the arc into the sink
    dev: np.ndarray  # (A,) device of the head node; -1 into the sink
    load: np.ndarray  # (A, R) work it adds: transfers into the head node, and the node itself
    time: np.ndarray  # (A,) ms: transfers into the head node, then its compute
    mem: np.ndarray  # (A,) bytes of buffers on `dev`
    exit: np.ndarray  # (S,) ms from a state's node finishing to its outputs at the egress
    n_states: int

    @property
    def copies(self) -> int:
        return len(self.members)

    @property
    def length(self) -> int:
        return len(self.members[0])

    @property
    def sink(self) -> int:
        return self.n_states - 1

    def path_of(self, devices: np.ndarray) -> np.ndarray:
        """The arcs (source to sink) of the copy whose nodes are on `devices`, in order."""
        out, here = [], 0
        for d in [*devices, -1]:
            a = next(a for a in np.flatnonzero(self.tail == here) if self.dev[a] == d)
            out.append(a)
            here = int(self.head[a])
        return np.array(out, np.intp)

    def latency(self, arcs: np.ndarray) -> np.ndarray:
        """Latency of paths given as rows of arc indices (source to sink)."""
        finish = np.cumsum(self.time[arcs], axis=1)
        out = finish + self.exit[self.head[arcs]]
        return np.maximum(0.0, out.max(axis=1))


def components(model: CostModel) -> list[tuple[int, ...]]:
    """Nodes connected by a tensor (a shared pipeline input connects its consumers too)."""
    parent = list(range(model.n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for r in model.refs:
        ends = ([r.src] if r.src >= 0 else []) + list(r.consumers)
        for e in ends[1:]:
            parent[find(e)] = find(ends[0])
    out: dict[int, list[int]] = defaultdict(list)
    for v in range(model.n):
        out[find(v)].append(v)
    return [tuple(c) for c in out.values()]


def _is_chain(comp: tuple[int, ...], refs_of: dict, inputs_of: dict) -> bool:
    """Each node feeds exactly the next; pipeline inputs reach only the first."""
    nxt = dict(itertools.pairwise(comp))
    for i, v in enumerate(comp):
        feeds = {c for r in refs_of[v] for c in r.consumers}
        if feeds != ({nxt[v]} if v in nxt else set()) or (i and inputs_of[v]):
            return False
    return True


def _signature(model: CostModel, comp: tuple[int, ...], refs_of: dict, inputs_of: dict) -> tuple:
    """Everything the state graph is built from: equal signatures, identical graphs."""
    inputs = sorted(r.nbytes for r in inputs_of[comp[0]])
    at = {v: i for i, v in enumerate(comp)}
    groups = sorted(
        (
            at[g.nodes[0]],
            len(g.nodes),
            g.delta.tobytes(),
            None if g.rows is None else (g.s0 - g.nodes[0], g.rows.shape, g.rows.tobytes()),
        )
        for g in model.groups
        if g.nodes[0] in at
    )
    nodes = tuple(
        (
            model.cost[v].tobytes(),
            float(model.mem[v]),
            tuple(sorted((r.nbytes, r.output, bool(r.consumers)) for r in refs_of[v])),
            tuple(sorted((d, k, ms) for sv, d, k, ms in model.side if sv == v)),
        )
        for v in comp
    )
    return (tuple(inputs), tuple(groups), nodes)


def chain_classes(model: CostModel) -> list[Chains] | None:
    """The DAG as classes of identical chains, or None when some component is not a chain."""
    members = class_members(model)
    if members is None:
        return None
    refs_of, inputs_of = _tensors(model)
    return [_graph(model, m, refs_of, inputs_of[m[0][0]]) for m in members]


def class_members(model: CostModel) -> list[tuple[tuple[int, ...], ...]] | None:
    """The node indices of each copy of each class of `chain_classes` (in its order), without
    building their state graphs; None when some component is not a chain."""
    refs_of, inputs_of = _tensors(model)
    by_sig: dict[tuple, list[tuple[int, ...]]] = defaultdict(list)
    at: dict[int, int] = {}
    for comp in components(model):
        if not _is_chain(comp, refs_of, inputs_of):
            return None
        at.update((v, i) for i, v in enumerate(comp))
        by_sig[_signature(model, comp, refs_of, inputs_of)].append(comp)
    for g in model.groups:  # a fused group must be a run of its chain (the runtime's is)
        if [at[v] - at[g.nodes[0]] for v in g.nodes] != list(range(len(g.nodes))):
            return None
    return [tuple(m) for m in by_sig.values()]


def _tensors(model: CostModel) -> tuple[dict[int, list], dict[int, list]]:
    """Per node, the tensors it produces, and the pipeline inputs it reads."""
    refs_of: dict[int, list] = defaultdict(list)
    inputs_of: dict[int, list] = defaultdict(list)
    for r in model.refs:
        if r.src >= 0:
            refs_of[r.src].append(r)
        else:
            for c in r.consumers:
                inputs_of[c].append(r)
    return refs_of, inputs_of


def _graph(
    model: CostModel, members: tuple[tuple[int, ...], ...], refs_of: dict, inputs: list
) -> Chains:
    comp = members[0]
    k, D, R = len(comp), len(model.devices), len(model.resources)
    # A run's fused deltas are added once its cover is known (`fusion`): on the arc into a
    # position before a cut, or on the arc that leaves its device. A state counts how many
    # positions of its run are still pending (0 after a cut). Several groups may end at one
    # node (one per device kind with the fused kernel); `settle_table` sums them per device.
    fused, cut = settle_table(model), group_cuts(model)
    after = [i == k - 1 or comp[i + 1] != comp[i] + 1 or bool(cut[comp[i + 1]]) for i in range(k)]
    seg = [0] * k  # the first position of each position's segment between cuts
    for i in range(1, k):
        seg[i] = i if after[i - 1] else seg[i - 1]
    runs = max((i - seg[i] + 1 for i in range(k) if not after[i]), default=0) + 1
    sink = 1 + k * D * runs

    def state(i: int, d: int, q: int) -> int:
        return 1 + (i * D + d) * runs + q

    def settled(p: int, i: int, d: int) -> float:
        return float(fused[comp[p], comp[i], d]) if p <= i else 0.0

    tail, head, pos, dev, loads, times, mems = [], [], [], [], [], [], []
    exit_ = np.full(sink + 1, -np.inf)
    # each tensor's (D, D, R) loads, once: `ref_load` builds the array anew at every call
    ref_loads = {
        id(r): model.ref_load(r) for r in [*inputs, *(r for v in comp for r in refs_of[v])]
    }

    def arc(t: int, i: int, d: int, p: int, load: np.ndarray, ms: float) -> None:
        """An arc from state t into position i on d (the sink: i == k, d == -1), the pending
        part of its run from p (a chain's last position is before a cut: none is left)."""
        own = 0.0
        if d >= 0:
            own = float(model.cost[comp[i], d]) + (settled(p, i, d) if after[i] else 0.0)
            load[d] += own
            for sv, sd, k, extra in model.side:  # `planner.side`: load on another resource
                if sv == comp[i] and sd == d:
                    load[k] += extra
        tail.append(t)
        head.append(sink if d < 0 else state(i, d, 0 if after[i] else i - p + 1))
        pos.append(i)
        dev.append(d)
        loads.append(load)
        times.append(ms + own)
        mems.append(model.mem[comp[i]] if d >= 0 else 0.0)

    for d in np.flatnonzero(np.isfinite(model.cost[comp[0]])):
        load = np.zeros(R)
        ms = 0.0
        for r in inputs:
            if d != model.ingress:
                load += ref_loads[id(r)][model.ingress, d]
            ms = max(ms, model.ref_time(r, model.ingress, d))
        arc(0, 0, d, 0, load, ms)
    for i, v in enumerate(comp):
        last = i == k - 1
        outs = [r for r in refs_of[v] if r.output]
        targets = [-1] if last else list(np.flatnonzero(np.isfinite(model.cost[comp[i + 1]])))
        pending = [0] if after[i] else range(1, i - seg[i] + 2)
        for s, q in itertools.product(np.flatnonzero(np.isfinite(model.cost[v])), pending):
            here = state(i, s, q)
            if outs:
                exit_[here] = max(model.ref_time(r, s, model.egress) for r in outs)
            for d in targets:
                load = np.zeros(R)
                ms = 0.0
                for r in refs_of[v]:
                    dests = {model.egress} if r.output else set()
                    if d >= 0:
                        dests.add(d)
                        ms = max(ms, model.ref_time(r, s, d))
                    for e in dests - {s}:
                        load += ref_loads[id(r)][s, e]
                p = i + 1 - q
                if d != s and q:  # the run on s ends at i
                    load[s] += settled(p, i, s)
                    ms += settled(p, i, s)
                arc(here, k if d < 0 else i + 1, d, p if d == s and q else i + 1, load, ms)
    return Chains(
        members=members,
        tail=np.array(tail, np.intp),
        head=np.array(head, np.intp),
        pos=np.array(pos, np.intp),
        dev=np.array(dev, np.intp),
        load=np.array(loads).reshape(-1, R),
        time=np.array(times, float),
        mem=np.array(mems, float),
        exit=exit_,
        n_states=sink + 1,
    )


def suffixes(ch: Chains) -> list[np.ndarray] | None:
    """Per state, the sorted distinct latencies the rest of the chain can add after its node
    finishes (its outputs' delivery included); None when they grow past MAX_SUFFIXES."""
    out: list[np.ndarray] = [np.empty(0)] * ch.n_states
    out[ch.sink] = np.array([-np.inf])
    by_tail: dict[int, list[int]] = defaultdict(list)
    for a, t in enumerate(ch.tail):
        by_tail[int(t)].append(a)
    for s in sorted(by_tail, key=lambda s: -s):  # heads come after tails in state order
        parts = [ch.time[a] + out[ch.head[a]] for a in by_tail[s] if len(out[ch.head[a]])]
        if not parts:
            continue
        vals = np.unique(np.maximum(ch.exit[s], np.concatenate(parts)))
        if len(vals) > MAX_SUFFIXES:
            return None
        out[s] = vals
    return out


@dataclass(frozen=True)
class Bucketed:
    """The state graph of a class expanded for one latency bound: every source-to-sink path
    of it keeps the bound, and every path of the chain that keeps it is one of them."""

    arc: np.ndarray  # (E,) the chain arc each expanded arc is
    tail: np.ndarray  # (E,) expanded states; 0 is the source
    head: np.ndarray
    n_states: int
    sink: int


def bucketed(ch: Chains, suff: list[np.ndarray] | None, bound: float) -> Bucketed:
    """Expand `ch` by the latency budget left at each state (see the module docstring).

    A budget is rounded down to the largest completion latency that still fits, so two
    budgets admitting the same completions meet in one state. Comparisons allow 1e-10 of the
    class's longest latency per step for float rounding, well inside the REL_TOL every
    objective is judged by. Past the source every budget is such a latency, so the graph
    depends on the bound only through where the source's arcs round to (`bucket_key`).
    """
    if not np.isfinite(bound):
        return Bucketed(np.arange(len(ch.tail)), ch.tail, ch.head, ch.n_states, ch.sink)
    assert suff is not None
    eps = _eps(suff)
    ids: dict[tuple[int, float], int] = {(0, bound * (1 + REL_TOL / 2)): 0}
    budgets: dict[int, list[float]] = defaultdict(list)
    budgets[0].append(bound * (1 + REL_TOL / 2))
    out_arcs: dict[int, list[int]] = defaultdict(list)
    for a, t in enumerate(ch.tail):
        out_arcs[int(t)].append(a)
    arcs, tails, heads = [], [], []
    # as Python floats, searched with bisect: the same comparisons as np.searchsorted's, without
    # its cost per call (this loop runs once per expanded arc)
    head, time = ch.head.tolist(), ch.time.tolist()
    lists: dict[int, list[float]] = {}
    for s in sorted(out_arcs):  # every arc goes to a later state
        for b in budgets.get(s, ()):
            src = ids[(s, b)]
            for a in out_arcs[s]:
                h = head[a]
                sh = lists.get(h)
                if sh is None:
                    sh = lists[h] = suff[h].tolist()
                j = bisect_right(sh, b - time[a] + eps) - 1
                if j < 0:
                    continue
                key = (h, sh[j])
                if key not in ids:
                    ids[key] = len(ids)
                    budgets[h].append(key[1])
                arcs.append(a)
                tails.append(src)
                heads.append(ids[key])
    sink = ids.get((ch.sink, -np.inf), len(ids))
    return Bucketed(
        np.array(arcs, np.intp), np.array(tails, np.intp), np.array(heads, np.intp), len(ids), sink
    )


def _eps(suff: list[np.ndarray]) -> float:
    """Float rounding allowed per step: 1e-10 of the class's longest completion latency."""
    top = suff[0][-1] if len(suff[0]) else 0.0
    return abs(float(top)) * 1e-10 if np.isfinite(top) else 0.0


def bucket_key(ch: Chains, suff: list[np.ndarray], bound: float) -> bytes:
    """What `bucketed(ch, suff, bound)` depends on the bound by: where each arc out of the
    source rounds its budget to. Bounds with equal keys give identical graphs."""
    if not np.isfinite(bound):
        return b"inf"
    out = np.flatnonzero(ch.tail == 0)
    b, eps = bound * (1 + REL_TOL / 2), _eps(suff)
    j = [np.searchsorted(suff[int(ch.head[a])], b - ch.time[a] + eps, side="right") for a in out]
    return np.array(j, np.int64).tobytes()
