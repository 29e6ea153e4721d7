"""The solvers are exact: on random DAGs (up to 8 nodes) over random topologies (up to 4
devices) with random costs, their objective equals brute force for every objective, and no
placement they return breaks a pin (an allowed-device restriction) or a memory limit. DAGs of
parallel chains (identical copies among them) are solved as branch classes, and are tested as
such too."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nicoffload.planner.branches import chain_classes
from nicoffload.planner.cost import CostModel, Group, TensorRef, routes
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import OBJECTIVES, Goal, brute_force, evaluate
from nicoffload.planner.flow import placement
from nicoffload.planner.milp import solve_milp, solve_nodes
from nicoffload.planner.search import pack
from nicoffload.planner.solve import solve
from nicoffload.topology import Device, Link, Topology

SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def random_topology(rng: np.random.Generator) -> Topology:
    n = int(rng.choice([1, 2, 3, 3, 4, 4, 4]))
    kinds = ["cpu", *rng.choice(["cpu", "dpu", "gpu"], n - 1)]
    devices = tuple(
        Device(f"{k}{i}", str(k), 1, float(rng.integers(1, 17))) for i, k in enumerate(kinds)
    )
    pairs = {(int(rng.integers(0, i)), i) for i in range(1, n)}  # a spanning tree
    if n > 2 and rng.random() < 0.5:
        pairs.add((0, n - 1))  # and maybe a shortcut: routes then choose
    links = tuple(
        Link(
            devices[a].id,
            devices[b].id,
            str(rng.choice(["tcp", "shm", "rdma", "pcie"])),
            float(10 ** rng.uniform(8, 11)),
            float(rng.uniform(0, 0.2)),
            float(rng.choice([0.0, 0.0, 0.1, 0.5])),
        )
        for a, b in sorted(pairs)
    )
    ids = [d.id for d in devices]
    return Topology("random", devices, links, str(rng.choice(ids)), str(rng.choice(ids)))


def _model(topo, rt, cost, groups, refs, mem, mem_cap) -> CostModel:
    """The CostModel of random nodes (cost rows) on a random topology and its routes."""
    n = len(cost)
    return CostModel(
        nodes=tuple(f"n{v}" for v in range(n)),
        devices=topo.ids,
        resources=rt.resources,
        divisor=rt.divisor,
        cost=cost,
        why_not={},
        work=np.ones(n),
        groups=tuple(groups),
        refs=tuple(refs),
        route_load=rt.load,
        route_ms=rt.ms,
        route_ms_per_byte=rt.ms_per_byte,
        mem=mem,
        mem_cap=mem_cap,
        host=np.array([d.kind == "cpu" for d in topo.devices]),
        ingress=topo.ids.index(topo.ingress),
        egress=topo.ids.index(topo.egress),
    )


def random_model(seed: int, chain: bool | None = None) -> CostModel:
    """A random DAG (or chain) of up to 8 nodes on a random topology, with random profiles."""
    rng = np.random.default_rng(seed)
    topo = random_topology(rng)
    rt = routes(topo)
    D, n = len(topo.devices), int(rng.integers(1, 9))
    chain = bool(rng.random() < 0.5) if chain is None else chain
    preds = [
        [v - 1] if chain else sorted(set(rng.integers(-1, v, int(rng.integers(1, 3))).tolist()))
        for v in range(n)
    ]  # -1: the pipeline input
    consumers = {u: tuple(v for v in range(n) if u in preds[v]) for u in range(-1, n)}
    refs = [TensorRef("in", -1, consumers[-1], False, float(10 ** rng.uniform(3, 6)))]
    for u in range(n):
        out = not consumers[u] or rng.random() < 0.15
        refs.append(TensorRef(f"n{u}", u, consumers[u], out, float(10 ** rng.uniform(3, 6))))
    cost = rng.uniform(0.01, 5.0, (n, D)) * rng.uniform(0.2, 5.0, D)  # faster, slower devices
    allowed = rng.random((n, D)) < 0.8  # kernels that exist, pins
    allowed[np.arange(n), rng.integers(0, D, n)] = True
    groups, v = [], 0
    while v < n - 1:
        fusable = consumers[v] == (v + 1,) and preds[v + 1] == [v] and not refs[v + 1].output
        if fusable and rng.random() < 0.5:
            delta = np.where(rng.random(D) < 0.3, np.nan, rng.uniform(-0.5, 0.2, D))
            groups.append(Group((v, v + 1), "a+b", delta))
            v += 1
        v += 1
    mem = rng.uniform(1.0, 10.0, n)
    mem_cap = rng.choice([np.inf, np.inf, 0.4, 0.7, 0.9], D) * mem.sum()
    return _model(topo, rt, np.where(allowed, cost, np.inf), groups, refs, mem, mem_cap)


def random_branches(seed: int) -> CostModel:
    """Parallel chains (a multi-camera request): 1-3 kinds of chain, each 1-3 nodes long with
    1-4 identical copies, up to 8 nodes; copies interleaved in the topological order (as a
    pipeline file lists them) or one after the other (then fused groups can exist)."""
    rng = np.random.default_rng(seed)
    topo = random_topology(rng)
    rt = routes(topo)
    D = len(topo.devices)
    kinds, n = [], 0
    while n < 8 and (not kinds or rng.random() < 0.7):
        length = int(rng.integers(1, 4))
        copies = int(rng.integers(1, 5))
        copies = min(copies, (8 - n) // length)
        if copies == 0:
            break
        kinds.append((length, copies))
        n += length * copies
    chains = [(k, j) for k, (_, copies) in enumerate(kinds) for j in range(copies)]
    interleave = rng.random() < 0.5
    if interleave:  # position-major: dec0, dec1, rs0, rs1, ...
        order = [(c, i) for i in range(3) for c in range(len(chains)) if i < kinds[chains[c][0]][0]]
    else:
        order = [(c, i) for c in range(len(chains)) for i in range(kinds[chains[c][0]][0])]
    index = {key: v for v, key in enumerate(order)}
    per_kind = []
    for length, _ in kinds:
        cost = rng.uniform(0.01, 5.0, (length, D)) * rng.uniform(0.2, 5.0, D)
        allowed = rng.random((length, D)) < 0.8
        allowed[np.arange(length), rng.integers(0, D, length)] = True
        nbytes = 10 ** rng.uniform(3, 6, length + 1)
        per_kind.append((np.where(allowed, cost, np.inf), nbytes, rng.uniform(1.0, 10.0, length)))
    cost = np.empty((n, D))
    mem = np.empty(n)
    refs, groups = [], []
    for c, (k, j) in enumerate(chains):
        kcost, nbytes, kmem = per_kind[k]
        length = kinds[k][0]
        nodes = [index[c, i] for i in range(length)]
        cost[nodes], mem[nodes] = kcost, kmem
        if j and rng.random() < 0.2:  # a pinned copy is a class of its own
            cost[nodes[0], rng.integers(0, D)] = np.inf
            cost[nodes[0], np.argmin(kcost[0])] = kcost[0].min()
        refs.append(TensorRef(f"in{c}", -1, (nodes[0],), False, float(nbytes[0])))
        for i, v in enumerate(nodes):
            last = i == length - 1
            consumers = () if last else (nodes[i + 1],)
            refs.append(TensorRef(f"n{v}", v, consumers, last, float(nbytes[i + 1])))
            if not last and not interleave and k == 0 and i == 0:
                delta = np.where(rng.random(D) < 0.3, np.nan, rng.uniform(-0.5, 0.2, D))
                groups.append(Group((v, v + 1), "a+b", delta))
    mem_cap = rng.choice([np.inf, np.inf, 0.4, 0.7, 0.9], D) * mem.sum()
    return _model(topo, rt, cost, groups, sorted(refs, key=lambda r: r.src), mem, mem_cap)


def random_goal(model: CostModel, seed: int) -> Goal:
    """An objective and, half the time, a throughput floor and a latency SLO near what is possible."""
    rng = np.random.default_rng(seed + 1)
    objective = str(rng.choice(OBJECTIVES))
    free = brute_force(model, Goal("latency"))
    if free is None or rng.random() < 0.5:
        return Goal(objective)
    m = free[1]
    floor = 1e3 / (float(m.bottleneck[0]) * rng.uniform(0.7, 2.0))
    slo = float(m.latency[0]) * rng.uniform(0.9, 2.0)
    return Goal(objective, floor if rng.random() < 0.5 else None, slo)


SEEDS = st.integers(0, 2**32 - 1)


def _primary(model: CostModel, goal: Goal, placement: np.ndarray) -> float:
    return float(evaluate(model, placement[None, :]).keys(goal.objective)[0][0])


def _check_valid(model: CostModel, goal: Goal, placement: np.ndarray) -> None:
    m = evaluate(model, placement[None, :])
    assert model.allowed[np.arange(model.n), placement].all(), "a pin or kernel was ignored"
    assert np.all(m.memory[0] <= model.mem_cap), "a memory limit was broken"
    assert m.feasible(goal)[0], "the SLO or the throughput floor was broken"


def _agrees_with_brute_force(model: CostModel, goal: Goal, placement: np.ndarray | None) -> None:
    truth = brute_force(model, goal)
    if truth is None:
        assert placement is None
        return
    best = _primary(model, goal, truth[0])
    assume(_not_on_a_boundary(model, goal, truth[0]))
    assert placement is not None
    _check_valid(model, goal, placement)
    assert _primary(model, goal, placement) == pytest.approx(best, rel=1e-6, abs=1e-9)


def _not_on_a_boundary(model: CostModel, goal: Goal, placement: np.ndarray) -> bool:
    """Solver tolerances may decide differently when a constraint is met to within 1e-6."""
    m = evaluate(model, placement[None, :])
    near = lambda x, cap: np.isfinite(cap) and abs(x - cap) <= 1e-6 * cap  # noqa: E731
    return not (near(m.bottleneck[0], goal.max_load_ms) or near(m.latency[0], goal.latency_cap))


@SETTINGS
@given(SEEDS)
def test_the_planner_matches_brute_force_on_random_dags(seed: int) -> None:
    model = random_model(seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve(model, goal))


@SETTINGS
@given(SEEDS)
def test_the_chain_dp_matches_brute_force(seed: int) -> None:
    model = random_model(seed, chain=True)
    assert is_chain(model)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_chain(model, goal))


@SETTINGS
@given(SEEDS)
def test_the_milp_matches_brute_force(seed: int) -> None:
    model = random_model(seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(SEEDS)
def test_the_per_node_milp_matches_brute_force_on_any_dag(seed: int) -> None:
    """Chains and parallel chains go to branch classes; the per-node program stays exact on
    them too (it is the fallback when their latencies are too many to search)."""
    model = random_model(seed) if seed % 2 else random_branches(seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


def _runner_up_is_the_second_best(model: CostModel, goal: Goal) -> None:
    best = solve_milp(model, goal).placement
    assume(best is not None)
    second = solve_milp(model, goal, exclude=best).placement
    allowed = [np.flatnonzero(model.allowed[v]) for v in range(model.n)]
    others = np.array(list(itertools.product(*allowed)))
    others = others[~np.all(others == best, axis=1)]
    m = evaluate(model, others)
    ok = m.feasible(goal) if len(others) else np.zeros(0, bool)
    if not ok.any():
        assert second is None
        return
    assert second is not None and not np.array_equal(second, best)
    _check_valid(model, goal, second)
    assert _primary(model, goal, second) == pytest.approx(
        m.keys(goal.objective)[0][ok].min(), rel=1e-6, abs=1e-9
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(SEEDS)
def test_the_milp_runner_up_is_the_second_best_placement(seed: int) -> None:
    model = random_model(seed)
    _runner_up_is_the_second_best(model, Goal(str(np.random.default_rng(seed).choice(OBJECTIVES))))


@SETTINGS
@given(SEEDS)
def test_parallel_chains_are_planned_exactly_as_branch_classes(seed: int) -> None:
    model = random_branches(seed)
    assert chain_classes(model) is not None
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(SEEDS)
def test_the_runner_up_of_parallel_chains_is_the_second_best_placement(seed: int) -> None:
    model = random_branches(seed)
    _runner_up_is_the_second_best(model, random_goal(model, seed))


def _random_paths(model: CostModel, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class of chains, each copy on a random path of its state graph."""
    out = []
    for ch in chain_classes(model):
        rows = []
        for _ in range(ch.copies):
            s, arcs = 0, []
            while s != ch.sink:
                a = int(rng.choice(np.flatnonzero(ch.tail == s)))
                arcs.append(a)
                s = int(ch.head[a])
            rows.append(arcs)
        out.append(np.array(rows, np.intp))
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(SEEDS)
def test_the_packing_search_keeps_its_caps_and_never_returns_worse_than_its_start(seed):
    model = random_branches(seed)
    classes = chain_classes(model)
    rng = np.random.default_rng(seed)
    start = _random_paths(model, rng)
    m0 = evaluate(model, placement(model, classes, start)[None, :])
    h_cap = float(m0.host[0]) * rng.uniform(0.5, 1.5)
    lat_cap = float(m0.latency[0]) * rng.uniform(0.5, 1.5)
    got = pack(model, classes, start, 0.0, h_cap, lat_cap, budget_s=5.0, seed=seed)
    start_ok = m0.ok[0] and m0.host[0] <= h_cap and m0.latency[0] <= lat_cap
    if got is None:
        assert not start_ok
        return
    m = evaluate(model, placement(model, classes, got.paths)[None, :])
    assert m.ok[0], "a kernel, pin or memory limit was broken"
    assert m.host[0] <= h_cap * (1 + 1e-6) + 1e-12
    assert m.latency[0] <= lat_cap * (1 + 1e-6) + 1e-12
    assert m.bottleneck[0] == pytest.approx(got.t, rel=1e-9)
    assert m.host[0] == pytest.approx(got.h, rel=1e-9, abs=1e-12)
    if start_ok:
        assert got.t <= m0.bottleneck[0] * (1 + 1e-9)
