"""On the runtime's general path a DPU stage holds the host process's interpreter too (the host
hands its rows to the agent and puts what comes back into the batch: `cost.host_serial`); the
simulator's route gives that stage the same interpreter time the planner charges it, and does
not cap it at the DPU's own time (the host's work, not the DPU's)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_planner_host_serial import TOPOLOGY as GPU_TOPOLOGY  # host and GPU

from nicoffload.fleet.model import _route
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_placement
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.planner.evaluate import serial_load
from nicoffload.planner.solve import resolve_profiles
from nicoffload.profiles import KernelCost, Profile
from nicoffload.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
OPS = ("decode_image", "resize", "center_crop", "normalize")
TOPOLOGY = """\
name: host-and-dpu
ingress: cpu
devices:
  cpu: {kind: cpu, cores: 8}
  dpu0: {kind: dpu, cores: 8}
links:
  - {between: [cpu, dpu0], transport: tcp, bandwidth: 100000Gb/s, latency: 1us}
"""


def _profile(kind: str, **runtime) -> Profile:
    ms = {"decode_image": 2.0, "resize": 0.5, "center_crop": 0.05, "normalize": 0.02}
    kernels = {op: KernelCost(ms[op], 0.0, "pixels") for op in OPS}
    return Profile(kind, kernels, method="measured: by hand, for a test", **runtime)


def _held_and_charged(
    tmp_path: Path, topology_text: str, given: list[Profile], placement: tuple[str, ...]
) -> tuple[float, float]:
    """(the host interpreter time the simulator's route holds per item, the planner's
    `serial_load`) of `placement` on the topology, priced by `given` profiles."""
    path = tmp_path / "topology.yaml"
    path.write_text(topology_text)
    topology = load_topology(path)
    profiles = resolve_profiles(topology, given)
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    catalog = Catalog.from_registry()
    model = build_model(pipeline, topology, profiles, catalog)
    single = build_model(replace(pipeline, batch_max_size=1), topology, profiles, catalog)
    pinned = dict(zip(model.nodes, placement, strict=True))
    plan = plan_placement(pipeline, pinned, str(path), given)
    best = np.array([model.devices.index(d) for d in placement], np.intp)
    route = _route(plan, model, single, best, pipeline.batch_max_size)
    size = pipeline.batch_max_size
    held = sum(v.serial_ms + v.serial_batch_ms / size for v in route.visits)
    return held, float(serial_load(model, best[None, :])[0])


@pytest.mark.parametrize(
    "placement",
    [
        ("cpu", "dpu0", "dpu0", "dpu0"),  # a DPU stage after a host one: the general path
        ("dpu0", "cpu", "cpu", "dpu0"),  # DPU -> host -> DPU
        ("dpu0", "cpu", "cpu", "cpu"),  # the fast path: the leading DPU stage holds none
    ],
)
def test_the_routes_interpreter_time_is_the_planners(tmp_path: Path, placement) -> None:
    cpu = _profile(
        "cpu",
        serial_us_per_item=10.0,
        serial_us_per_batch=0.0,
        serial_general_us_per_item=300.0,
        serial_general_us_per_batch=0.0,
    )
    held, charged = _held_and_charged(tmp_path, TOPOLOGY, [cpu, _profile("dpu")], placement)
    assert held == pytest.approx(charged, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "placement",
    [
        ("gpu0", "gpu0", "gpu0", "gpu0"),  # the fast path: a GPU stage fed by the host process
        ("cpu", "cpu", "gpu0", "gpu0"),
        ("gpu0", "gpu0", "cpu", "cpu"),  # the general path
    ],
)
def test_a_gpu_stages_interpreter_time_is_the_planners_too(tmp_path: Path, placement) -> None:
    """The host process feeds a GPU stage and hands its batches on: the planner charges the
    GPU profile's serial figures to the host's interpreter; the route held none of it."""
    cpu = _profile("cpu", serial_us_per_item=10.0, serial_us_per_batch=0.0)
    gpu = _profile("gpu", serial_us_per_item=200.0, serial_us_per_batch=640.0)
    held, charged = _held_and_charged(tmp_path, GPU_TOPOLOGY, [cpu, gpu], placement)
    assert held > 0
    assert held == pytest.approx(charged, rel=1e-9, abs=1e-12)
