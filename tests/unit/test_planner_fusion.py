"""The planner prices the kernels the runtime runs. For random small image pipelines (chains
and DAGs, one or two images) on random topologies, under random placements: the steps the
evaluator prices are exactly the (kernel chain, device) steps `runtime.stage.bind_steps` binds
on each stage of the plan, each device's compute is the sum of those steps' prices, and every
solver (DP, per-node MILP, branch flow) still finds the placement brute force finds.

The runtime's kernels are chosen, not built (building one compiles or needs a GPU library):
which chain runs is decided in bind_steps before `build` is called."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from test_planner_properties import (
    SEEDS,
    _agrees_with_brute_force,
    random_branches,
    random_goal,
    random_model,
)

from nicoffload import ops
from nicoffload.graph import load_pipeline
from nicoffload.planner import fusion
from nicoffload.planner.branches import chain_classes
from nicoffload.planner.cost import Catalog, Group, build_model, chain_work
from nicoffload.planner.dp import is_chain, solve_chain
from nicoffload.planner.evaluate import evaluate
from nicoffload.planner.milp import solve_milp, solve_nodes
from nicoffload.planner.plan import stages_for
from nicoffload.profiles import KernelCost, load_profile, profile_path
from nicoffload.runtime.stage import bind_steps
from nicoffload.topology import Device, Link, Topology, load_topology

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True)
MEAN = "{mean: [0.5, 0.4, 0.3], std: [0.2, 0.2, 0.2]"
SHIPPED = {"cpu": "x86-server", "dpu": "bluefield3-arm", "gpu": "h200"}


def random_pipeline(rng: np.random.Generator, folder: Path):
    """Decode, then up to 6 of resize / center_crop / normalize, each reading the last node
    (mostly) or an earlier one its op can take; outputs: the sinks and a few more."""
    images = int(rng.integers(1, 3))
    lines, state = [], {}  # node -> "u8" | "hwc" (float HWC: a crop may follow) | "chw"
    for k in range(images):
        lines.append(f"  - {{name: d{k}, op: decode_image, in: img{k}}}")
        state[f"d{k}"] = "u8"
    last = {}  # node -> op
    for v in range(int(rng.integers(1, 7))):
        names = list(state)
        src = names[-1] if rng.random() < 0.65 else str(rng.choice(names))
        if state[src] == "chw":
            src = str(rng.choice([n for n in names if state[n] != "chw"]))
        ops_ok = ["center_crop"] + (["resize", "resize", "normalize"] if state[src] == "u8" else [])
        usual = {None: "resize", "resize": "center_crop", "center_crop": "normalize"}
        op = usual.get(last.get(src))  # mostly the usual recipe: its fused kernels exist
        op = op if op in ops_ok and rng.random() < 0.7 else str(rng.choice(ops_ok))
        last[f"n{v}"] = op
        name = f"n{v}"
        if op == "resize":
            aa = "true" if rng.random() < 0.8 else "false"
            params = f"{{shorter: {int(rng.integers(32, 300))}, antialias: {aa}}}"
            state[name] = "u8"
        elif op == "center_crop":
            params = f"{{size: {int(rng.integers(16, 240))}}}"
            state[name] = state[src]
        else:
            layout = str(rng.choice(["hwc", "chw"]))
            params = f"{MEAN}, dtype: {rng.choice(['float16', 'float32'])}, layout: {layout}}}"
            state[name] = layout
        lines.append(f"  - {{name: {name}, op: {op}, in: {src}, params: {params}}}")
    read = {line.split("in: ")[1].split(",")[0].rstrip("}") for line in lines}
    outs = [n for n in state if n not in read or (rng.random() < 0.2 and not n.startswith("d"))]
    h, w = [(375, 500), (1536, 2048), (600, 800)][int(rng.integers(0, 3))]
    inputs = ", ".join(
        f"img{k}: {{kind: bytes, format: jpeg, typical: {{height: {h}, width: {w}, bytes: 90000}}}}"
        for k in range(images)
    )
    text = (
        f"name: random\ninputs: {{{inputs}}}\nnodes:\n"
        + "\n".join(lines)
        + "\noutputs: {"
        + ", ".join(f"o_{n}: {n}" for n in outs)
        + "}\n"
    )
    path = folder / "random.yaml"
    path.write_text(text)
    return load_pipeline(path)


def random_topology(rng: np.random.Generator) -> Topology:
    """The host CPU and some of a second host CPU, a DPU and a GPU, linked to the host."""
    extra = [d for d in ("cpu1", "dpu0", "gpu0") if rng.random() < 0.6]
    devices = (
        Device("cpu", "cpu", 8, 8.0),
        *(Device(d, d.rstrip("01"), 8, float(rng.integers(1, 17))) for d in extra),
    )
    links = tuple(Link("cpu", d, "rdma", 1e10, 0.01, 0.1) for d in extra)
    ids = [d.id for d in devices]
    return Topology("random", devices, links, str(rng.choice(ids)), str(rng.choice(ids)))


def profiles_for(topology: Topology, rng: np.random.Generator) -> dict:
    """The shipped profiles, with the two-op chains of host and DPU cores priced too (their
    estimates price only resize+center_crop+normalize), so that each fused step has a price
    of its own."""
    out = {}
    for dev in topology.devices:
        p = load_profile(profile_path(SHIPPED[dev.kind]))
        if dev.kind in ("cpu", "dpu"):
            extra = {
                key: KernelCost(
                    float(rng.uniform(0, 0.05)), float(rng.uniform(1e-7, 2e-6)), "pixels"
                )
                for key in ("resize+center_crop", "center_crop+normalize")
            }
            p = dataclasses.replace(p, kernels={**p.kernels, **extra})
        out[dev.id] = p
    return out


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as folder:
        pipeline = random_pipeline(rng, Path(folder))
    topology = random_topology(rng)
    profiles = profiles_for(topology, rng)
    model = build_model(pipeline, topology, profiles, Catalog.from_registry())
    return rng, pipeline, topology, profiles, model


def random_placement(model, rng: np.random.Generator) -> np.ndarray:
    """Each node where it may go, on its predecessor's device half the time (stages of several
    nodes, where fusion happens)."""
    out: list[int] = []
    for v in range(model.n):
        allowed = np.flatnonzero(model.allowed[v])
        stay = out and out[-1] in allowed and rng.random() < 0.5
        out.append(out[-1] if stay else int(rng.choice(allowed)))
    return np.array(out)


def runtime_steps(pipeline, topology: Topology, placement: dict[str, str]) -> list:
    """(node names, device) of every kernel bind_steps binds, stage by stage."""
    stages, transfers = stages_for(pipeline, placement)
    keep = {str(r) for r in pipeline.outputs.values()} | {t.tensor for t in transfers}
    real_get, real_fused = ops.get_kernel, ops.fused_kernels

    def stub(kernel: ops.Kernel) -> ops.Kernel:
        return dataclasses.replace(kernel, build=lambda nodes, consumers: None)

    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "get_kernel", lambda op, kind: stub(real_get(op, kind)))
        mp.setattr(ops, "fused_kernels", lambda kind: [stub(k) for k in real_fused(kind)])
        for s in stages:
            nodes = [pipeline.node(n) for n in s.nodes]
            for step in bind_steps(pipeline, nodes, topology.device(s.device).kind, keep):
                out.append((tuple(n.name for n in step.nodes), s.device))
    return out


def planner_steps(model, placement: np.ndarray) -> list:
    return [
        (tuple(model.nodes[v] for v in chain), model.devices[d])
        for chain, d in fusion.steps(model, placement)
    ]


@SETTINGS
@given(SEEDS)
def test_the_evaluator_prices_exactly_the_kernels_the_runtime_binds(seed: int) -> None:
    rng, pipeline, topology, _, model = random_case(seed)
    for _ in range(16):
        P = random_placement(model, rng)
        placement = {name: model.devices[d] for name, d in zip(model.nodes, P, strict=True)}
        assert sorted(planner_steps(model, P)) == sorted(
            runtime_steps(pipeline, topology, placement)
        )


@SETTINGS
@given(SEEDS)
def test_each_device_computes_the_sum_of_the_prices_of_its_steps(seed: int) -> None:
    rng, pipeline, topology, profiles, model = random_case(seed)
    # the same transfers, no compute
    moves_only = dataclasses.replace(model, cost=np.where(model.allowed, 0.0, np.inf), groups=())
    D = len(model.devices)
    for _ in range(16):
        P = random_placement(model, rng)
        placement = {name: model.devices[d] for name, d in zip(model.nodes, P, strict=True)}
        want = np.zeros(D)
        for names, dev in runtime_steps(pipeline, topology, placement):
            d = model.devices.index(dev)
            own = sum(model.cost[model.nodes.index(n), d] for n in names)
            entry = profiles[dev].kernel(tuple(pipeline.node(n).op for n in names))
            fused = len(names) > 1 and entry is not None
            want[d] += max(0.0, entry.ms(chain_work(pipeline, names))) if fused else own
        got = evaluate(model, P[None, :]).work[0, :D] - evaluate(moves_only, P[None, :]).work[0, :D]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


@SETTINGS
@given(SEEDS)
def test_every_solver_finds_the_best_placement_of_what_the_runtime_fuses(seed: int) -> None:
    _, _, _, _, model = random_case(seed)
    goal = random_goal(model, seed)
    if is_chain(model):
        _agrees_with_brute_force(model, goal, solve_chain(model, goal))
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)  # branch flow
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


@pytest.mark.parametrize(
    ("placement", "steps"),
    [
        ("DDCC", [("decode", "dpu0"), ("resize", "dpu0"), ("crop+norm", "cpu")]),
        ("CCCG", [("decode", "cpu"), ("resize+crop", "cpu"), ("norm", "gpu0")]),
        ("DCCC", [("decode", "dpu0"), ("resize+crop+norm", "cpu")]),
        ("CCGC", [("decode", "cpu"), ("resize", "cpu"), ("crop", "gpu0"), ("norm", "cpu")]),
    ],
)
def test_a_stage_fuses_from_its_own_first_node(placement: str, steps: list) -> None:
    """ResNet's decode and resize on the DPU leave crop and normalize to the host, which runs
    them as one crop+normalize kernel; resize and crop before a GPU normalize fuse too."""
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    topology = load_topology("pipelines/topologies/bluefield3-h100.yaml")
    profiles = {d.id: load_profile(profile_path(SHIPPED[d.kind])) for d in topology.devices}
    model = build_model(pipeline, topology, profiles, Catalog.from_registry())
    where = {"C": "cpu", "D": "dpu0", "G": "gpu0"}
    P = np.array([model.devices.index(where[c]) for c in placement])
    assert [("+".join(names), dev) for names, dev in planner_steps(model, P)] == steps


def tabled_model(seed: int, chain: bool | None = None, branches: bool = False):
    """A random model of test_planner_properties (a DAG, a chain, or parallel chains) whose
    fused windows overlap (lengths 2 and 3) and fuse by random tables of their run's start
    and end, shaped as `fusion.table` shapes them."""
    model = random_branches(seed) if branches else random_model(seed, chain)
    rng = np.random.default_rng(seed + 7)
    n, D = model.n, len(model.devices)
    feeds = [
        any(r.src == v and r.consumers == (v + 1,) and not r.output for r in model.refs)
        and not any(v + 1 in r.consumers for r in model.refs if r.src != v)
        for v in range(n)
    ]  # v and v + 1 may be in one window
    found = [
        (i, i + k - 1)
        for i in range(n)
        for k in (2, 3)
        if i + k <= n and all(feeds[i : i + k - 1]) and rng.random() < 0.5
    ]
    cut = fusion.cuts(n, found)
    groups = []
    for i, j in found:
        s0, rows = fusion.table(found, (i, j), cut)
        rows = rng.random(rows.shape) < 0.6
        own = model.cost[i : j + 1].sum(axis=0)
        delta = np.where(rng.random(D) < 0.3, np.nan, own * rng.uniform(-0.9, 0.1, D))
        delta = np.where(np.isfinite(delta), delta, np.nan)
        groups.append(Group(tuple(range(i, j + 1)), "a+b", delta, s0, rows))
    return dataclasses.replace(model, groups=tuple(groups))


@SETTINGS
@given(SEEDS)
def test_the_milp_is_exact_for_any_table_of_where_a_run_fuses(seed: int) -> None:
    model = tabled_model(seed)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_nodes(model, goal).placement)


@SETTINGS
@given(SEEDS)
def test_the_branch_flow_is_exact_for_any_table_of_where_a_run_fuses(seed: int) -> None:
    model = tabled_model(seed, branches=True)
    assert chain_classes(model) is not None
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_milp(model, goal).placement)


@SETTINGS
@given(SEEDS)
def test_the_chain_dp_is_exact_for_any_table_of_where_a_run_fuses(seed: int) -> None:
    model = tabled_model(seed, chain=True)
    goal = random_goal(model, seed)
    _agrees_with_brute_force(model, goal, solve_chain(model, goal))
