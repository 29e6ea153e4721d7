"""The solvers are exact: on random DAGs (up to 8 nodes) over random topologies (up to 4
devices) with random costs, their objective equals brute force for every objective, and no
placement they return breaks a pin (an allowed-device restriction) or a memory limit. DAGs of
parallel chains (identical copies among them) are solved as branch classes, and are tested as
such too. A fused window is priced, as build_model prices it, by one group or by one group per
device kind that has the fused kernel (several groups ending at one node)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nicoffload.graph import load_pipeline
from nicoffload.planner.branches import chain_classes
from nicoffload.planner.cost import Catalog, CostModel, Group, TensorRef, build_model, routes
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import OBJECTIVES, Goal, brute_force, evaluate
from nicoffload.planner.flow import placement
from nicoffload.planner.milp import solve_milp, solve_nodes
from nicoffload.planner.search import pack
from nicoffload.planner.solve import plan_for, resolve_profiles, solve
from nicoffload.profiles import SHIPPED_DIR
from nicoffload.topology import Device, Link, Topology, load_topology

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
            cpu_us_per_batch=float(rng.choice([0.0, 0.0, 30.0, 300.0])),
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
        route_fixed=rt.fixed,
        route_ms=rt.ms,
        route_ms_per_byte=rt.ms_per_byte,
        mem=mem,
        mem_cap=mem_cap,
        host=np.array([d.kind == "cpu" for d in topo.devices]),
        ingress=topo.ids.index(topo.ingress),
        egress=topo.ids.index(topo.egress),
    )


def fused_groups(
    topo: Topology, nodes: tuple[int, ...], own: np.ndarray, rng: np.random.Generator
) -> list[Group]:
    """A fused window's groups: its kernel costs from 10% more to 90% less than the nodes'
    own costs `own` (per device), as a measured fused kernel does. One group, or, as
    build_model makes them, one per device kind (each priced only on the devices of its kind),
    which then all end at the same node."""
    D = len(topo.devices)
    delta = np.where(rng.random(D) < 0.3, np.nan, own * rng.uniform(-0.9, 0.1, D))
    delta = np.where(np.isfinite(delta), delta, np.nan)
    if rng.random() < 0.3:
        return [Group(nodes, "a+b", delta)]
    kinds = np.array([d.kind for d in topo.devices])
    return [Group(nodes, "a+b", np.where(kinds == k, delta, np.nan)) for k in sorted(set(kinds))]


def random_model(seed: int, chain: bool | None = None) -> CostModel:
    """A random DAG (or chain) of up to 8 nodes on a random topology, with random profiles."""
    rng = np.random.default_rng(seed)
    topo = random_topology(rng)
    rt = routes(topo, int(rng.choice([1, 8, 64])))
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
            groups += fused_groups(topo, (v, v + 1), cost[v] + cost[v + 1], rng)
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
    rt = routes(topo, int(rng.choice([1, 8, 64])))
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
                groups += fused_groups(topo, (v, v + 1), kcost[i] + kcost[i + 1], rng)
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
    got = pack(model, classes, start, 0.0, h_cap, lat_cap, steps=5000, seed=seed)
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


# -- the shipped pipelines ----------------------------------------------------------------------
# What random models missed and clip has: two branches (an image chain and a tokenizer), fused
# windows priced by one group per device kind (host CPU and DPU both fuse resize+crop+normalize),
# the decode at the size its kernel decodes to, transfer CPU on a TCP loopback.

ROOT = Path(__file__).resolve().parents[2]
IMAGE_OPS = ("decode_image", "resize", "center_crop", "normalize")
FUSED = (
    ("resize", "center_crop", "normalize"),
    ("resize", "center_crop"),
    ("center_crop", "normalize"),
)
# The kernels the registry holds today, fixed so that these tests do not move with it.
KERNELS = Catalog(
    {
        **{op: frozenset({"cpu", "dpu", "gpu"}) for op in IMAGE_OPS},
        "tokenize": frozenset({"cpu", "dpu"}),
    },
    {kind: FUSED for kind in ("cpu", "dpu", "gpu")},
)


def local_like(host: int, dpu: int, gpu: bool = False) -> Topology:
    """This machine's shape (topology.local_topology): host cores, an emulated DPU on loopback
    TCP, maybe a GPU, with the shipped estimates, never this machine's measured profile."""
    x86 = str(SHIPPED_DIR / "x86-server.json")
    devices = [
        Device("cpu", "cpu", host, float(host), profile=x86),
        Device("dpu0", "dpu", dpu, float(dpu), profile=x86, emulated=True),
    ]
    links = [Link("dpu0", "cpu", "tcp", 2.5e9, 0.03, 0.25)]
    if gpu:
        devices.append(Device("gpu0", "gpu", 1, 1.0, profile=str(SHIPPED_DIR / "h100.json")))
        links.append(Link("cpu", "gpu0", "pcie", 25e9, 0.005, 0.0))
    return Topology("local-like", tuple(devices), tuple(links), "dpu0", "gpu0" if gpu else "cpu")


TOPOLOGIES = {
    "local 1+1": lambda: local_like(1, 1),
    "local 2+2": lambda: local_like(2, 2),
    "local 1+2": lambda: local_like(1, 2),
    "local 8+8 gpu": lambda: local_like(8, 8, gpu=True),
    **{
        name: (lambda name=name: load_topology(ROOT / "pipelines" / "topologies" / f"{name}.yaml"))
        for name in ("bluefield3-h100", "bluefield2-a100", "edge-25g", "host-only")
    },
}


def _placed(model: CostModel, plan) -> np.ndarray:
    return np.array([model.devices.index(plan.placement[n]) for n in model.nodes])


@pytest.mark.parametrize("name", ["resnet50", "bert", "clip"])
@pytest.mark.parametrize("where", sorted(TOPOLOGIES))
def test_a_plan_of_a_shipped_pipeline_proven_optimal_is_the_brute_force_optimum(name, where):
    """Brute force over every assignment of nodes to the devices they may use (every pin),
    judged by the planner's own evaluator, for every objective."""
    pipeline = load_pipeline(ROOT / "pipelines" / f"{name}.yaml")
    topo = TOPOLOGIES[where]()
    model = build_model(pipeline, topo, resolve_profiles(topo), KERNELS)
    for objective in OBJECTIVES:
        goal = Goal(objective)
        plan = plan_for(pipeline, topo, objective=objective, catalog=KERNELS)
        best = _primary(model, goal, brute_force(model, goal)[0])
        got = _primary(model, goal, _placed(model, plan))
        assert got <= best * (1 + 1e-6) + 1e-12, f"{objective}: beaten by a pinned placement"
        assert plan.search["gap"] == 0, objective  # small enough to be proven at once
        assert got == pytest.approx(best, rel=1e-6, abs=1e-12), objective


def test_pinning_clip_to_the_best_placement_plans_nothing_better_than_clip_unpinned(tmp_path):
    """The issue's check: clip planned unpinned ("proven optimal"), then with `placement:`
    pins on the best placement brute force finds; the pinned plan is no better."""
    topo = local_like(2, 2)
    text = (ROOT / "pipelines" / "clip.yaml").read_text()
    clip = load_pipeline(ROOT / "pipelines" / "clip.yaml")
    model = build_model(clip, topo, resolve_profiles(topo), KERNELS)
    for objective in OBJECTIVES:
        goal = Goal(objective)
        best = brute_force(model, goal)[0]
        pins = ", ".join(
            f"{n}: [{topo.devices[d].kind}:{topo.ids[d]}]"
            for n, d in zip(model.nodes, best, strict=True)
        )
        path = tmp_path / f"clip-{objective}.yaml"
        path.write_text(f"{text}placement: {{{pins}}}\n")
        pinned = plan_for(load_pipeline(path), topo, objective=objective, catalog=KERNELS)
        free = plan_for(clip, topo, objective=objective, catalog=KERNELS)
        assert _placed(model, pinned).tolist() == best.tolist()
        assert (
            _primary(model, goal, _placed(model, free))
            <= _primary(model, goal, best) * (1 + 1e-6) + 1e-12
        ), objective
