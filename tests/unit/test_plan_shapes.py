"""Plans of the shapes the runtime runs: the planner's rule agrees with the executor's, and
`runnable=True` returns the best runnable placement (checked against brute force) and says what
the unrunnable optimum would have given."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from nicoffload.errors import DeviceError
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.planner.evaluate import Goal, best_row, evaluate
from nicoffload.planner.shapes import runnable
from nicoffload.planner.solve import allowed_mask, resolve_profiles
from nicoffload.runtime.executor import split_stages
from nicoffload.topology import load_topology

# A host, an emulated DPU where requests enter, and an H200 (its measured profile): for
# throughput the best placement decodes on the GPU and comes back to the host.
TOPOLOGY = """\
name: gpu-box
ingress: dpu0
egress: cpu
devices:
  cpu: {kind: cpu, cores: 8, memory: 64GiB, profile: x86-server}
  dpu0: {kind: dpu, cores: 8, memory: 64GiB, profile: x86-server}
  gpu0: {kind: gpu, memory: 140GiB, profile: h200}
links:
  - {between: [cpu, gpu0], transport: pcie, bandwidth: 55GB/s, latency: 10us}
  - {between: [cpu, dpu0], transport: tcp, bandwidth: 10GB/s, latency: 30us}
"""


@pytest.fixture
def topo(tmp_path: Path) -> Path:
    path = tmp_path / "gpu-box.yaml"
    path.write_text(TOPOLOGY)
    return path


def test_the_planner_and_the_executor_agree_on_what_runs(topo: Path) -> None:
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    free = plan_for(pipeline, topo)
    assert [s.kind for s in free.stages] == ["gpu", "cpu"]  # the optimum goes back to the host
    assert any("not a shape the runtime runs" in n for n in free.notes)
    with pytest.raises(DeviceError):
        split_stages(free)
    ran = plan_for(pipeline, topo, runnable=True)
    split_stages(ran)  # runs
    assert ran.predicted.throughput_per_s <= free.predicted.throughput_per_s
    (note,) = [n for n in ran.notes if "best placement overall" in n]
    assert "gpu -> cpu" in note and "the best one it runs" in note


def test_a_runnable_plan_that_is_not_the_best_overall_is_proven_only_among_runnable_shapes(
    topo: Path,
) -> None:
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    free = plan_for(pipeline, topo)
    ran = plan_for(pipeline, topo, runnable=True)
    assert free.search["method"] == "dynamic programming" and free.search["gap"] == 0
    assert ran.search["method"] == "dynamic programming, per shape the runtime runs"
    assert ran.search["gap"] == 0  # every cut searched, each exact


def test_runnable_plans_are_the_best_runnable_placement(topo: Path) -> None:
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    t = load_topology(topo)
    model = build_model(pipeline, t, resolve_profiles(t), Catalog.from_registry())
    allowed = allowed_mask(pipeline, t, model)
    every = np.array(
        [
            p
            for p in itertools.product(range(len(model.devices)), repeat=model.n)
            if runnable(model, p)
        ]
    )
    every = every[evaluate(model, every).ok & allowed[np.arange(model.n), every].all(axis=1)]
    for objective in ("throughput", "latency", "host-cpu"):
        goal = Goal(objective)
        want = every[best_row(evaluate(model, every), goal)]
        got = plan_for(pipeline, topo, objective=objective, runnable=True)
        placed = np.array([model.devices.index(got.placement[n]) for n in model.nodes])
        primary, _ = evaluate(model, np.array([want, placed])).keys(objective)
        assert primary[1] <= primary[0] * (1 + 1e-9) + 1e-12, objective  # as good as brute force


@pytest.mark.parametrize(
    ("kinds", "runs"),
    [
        (["dpu", "cpu", "gpu"], True),
        (["cpu"], True),
        (["dpu", "gpu"], True),
        (["gpu"], True),
        (["gpu", "cpu"], False),
        (["cpu", "dpu"], False),
        (["dpu", "cpu", "dpu"], False),
        (["cpu", "gpu", "cpu"], False),
    ],
)
def test_which_stage_shapes_run(topo: Path, kinds: list[str], runs: bool) -> None:
    t = load_topology(topo)
    pipeline = load_pipeline("pipelines/resnet50.yaml")
    model = build_model(pipeline, t, resolve_profiles(t), Catalog.from_registry())
    index = {
        k: model.devices.index(d) for k, d in (("cpu", "cpu"), ("dpu", "dpu0"), ("gpu", "gpu0"))
    }
    placement = [index[k] for k in kinds]
    assert runnable(model, placement) is runs


def test_the_cuts_searched_are_those_that_leave_every_node_a_device() -> None:
    """`_cuts` finds them from each node's devices, without a mask per cut (a 200-node DAG has
    hundreds of thousands): the same set as building every mask."""
    from nicoffload.planner.shapes import _cuts

    rng = np.random.default_rng(7)
    kinds = np.array(["cpu", "cpu", "dpu", "dpu", "gpu", "gpu"])
    dpus, gpus, on_cpu = (
        np.flatnonzero(kinds == "dpu"),
        np.flatnonzero(kinds == "gpu"),
        kinds == "cpu",
    )
    for _ in range(20):
        allowed = rng.random((7, len(kinds))) < 0.8
        got = set(_cuts(allowed, dpus, gpus, on_cpu))
        want = set()
        n = len(allowed)
        for i in range(n + 1):
            for j in range(i, n + 1):
                for dpu in dpus if i else [None]:
                    for gpu in gpus if j < n else [None]:
                        mask = allowed.copy()
                        if i:
                            mask[:i] &= np.arange(len(kinds)) == dpu
                        mask[i:j] &= on_cpu
                        if j < n:
                            mask[j:] &= np.arange(len(kinds)) == gpu
                        if mask.any(axis=1).all():
                            want.add(
                                (
                                    i,
                                    j,
                                    None if dpu is None else int(dpu),
                                    None if gpu is None else int(gpu),
                                )
                            )
        assert got == want
