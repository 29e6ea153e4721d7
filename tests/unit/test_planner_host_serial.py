"""The host runs its stages in threads of one Python process: what the Python around their
kernels holds the GIL for per item is one serial resource shared by every host stage, and it
caps a plan's throughput whatever the host's core count."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nicoffload.errors import ProfileError
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for, plan_placement
from nicoffload.planner.cost import Catalog, build_model
from nicoffload.planner.evaluate import evaluate, figures
from nicoffload.planner.solve import resolve_profiles
from nicoffload.profiles import KernelCost, Profile, load_profile
from nicoffload.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
OPS = ("decode_image", "resize", "center_crop", "normalize")

# A host of 8 cores and a GPU on a link too wide to matter: the GPU alone is busy 0.060 ms per
# item with the whole pipeline, 0.055 without normalize, which 8 host cores do at 0.025 ms/item.
TOPOLOGY = """\
name: host-and-gpu
ingress: cpu
egress: gpu0
devices:
  cpu: {kind: cpu, cores: 8}
  gpu0: {kind: gpu}
links:
  - {between: [cpu, gpu0], transport: pcie, bandwidth: 100000Gb/s, latency: 1us}
"""
GPU_MS = {"decode_image": 0.040, "resize": 0.010, "center_crop": 0.005, "normalize": 0.005}
CPU_MS = {"decode_image": 2.0, "resize": 0.5, "center_crop": 0.5, "normalize": 0.2}
SPLIT = {"decode": "gpu0", "resize": "gpu0", "crop": "gpu0", "norm": "cpu"}
ALL_GPU = dict.fromkeys(SPLIT, "gpu0")


def _profile(kind: str, ms: dict[str, float], **runtime) -> Profile:
    kernels = {op: KernelCost(ms[op], 0.0, "pixels") for op in OPS}
    return Profile(kind, kernels, method="measured: by hand, for a test", **runtime)


def _case(tmp_path: Path, **serial):
    topo = tmp_path / "topology.yaml"
    topo.write_text(TOPOLOGY)
    profiles = [_profile("cpu", CPU_MS, **serial), _profile("gpu", GPU_MS)]
    return load_pipeline(ROOT / "pipelines" / "resnet50.yaml"), str(topo), profiles


def _model(tmp_path: Path, **serial):
    pipeline, topo_path, profiles = _case(tmp_path, **serial)
    topology = load_topology(topo_path)
    model = build_model(
        pipeline, topology, resolve_profiles(topology, profiles), Catalog.from_registry()
    )
    return model, topology


def _row(model, placement: dict[str, str]) -> np.ndarray:
    return np.array([[model.devices.index(placement[n]) for n in model.nodes]])


def test_the_split_plan_is_capped_by_the_host_processs_serial_time(tmp_path: Path) -> None:
    pipeline, topo, profiles = _case(tmp_path, serial_us_per_item=100.0, serial_us_per_batch=0.0)
    split = plan_placement(pipeline, SPLIT, topo, profiles)
    # 8 cores would do normalize at 0.025 ms/item; the interpreter does its rows one at a time
    assert split.predicted.throughput_per_s == pytest.approx(1e3 / 0.100, rel=1e-6)


def test_the_planner_prefers_all_gpu_when_the_hosts_serial_time_makes_the_split_slower(
    tmp_path: Path,
) -> None:
    pipeline, topo, profiles = _case(tmp_path, serial_us_per_item=100.0, serial_us_per_batch=0.0)
    plan = plan_for(pipeline, topo, profiles, explain=True)
    assert dict(plan.placement) == ALL_GPU
    assert plan.predicted.throughput_per_s == pytest.approx(1e3 / 0.060, rel=1e-3)
    lost = plan.explain["runner_up"]
    assert lost["bottleneck"]["kind"] == "serial"
    assert "host process (one Python interpreter): 10000 items/s" in lost["why"]


def test_a_host_stage_whose_serial_time_does_not_bind_keeps_the_split(tmp_path: Path) -> None:
    pipeline, topo, profiles = _case(tmp_path, serial_us_per_item=10.0, serial_us_per_batch=0.0)
    plan = plan_for(pipeline, topo, profiles, explain=True)
    assert dict(plan.placement) == SPLIT
    assert plan.predicted.throughput_per_s == pytest.approx(1e3 / 0.055, rel=1e-3)
    assert plan.explain["bottleneck"]["resource"] == "gpu0"
    assert plan.explain["host_process"]["load_ms_per_item"] == pytest.approx(0.010)


def test_a_profile_without_the_serial_term_caps_nothing(tmp_path: Path) -> None:
    pipeline, topo, profiles = _case(tmp_path)
    assert dict(plan_for(pipeline, topo, profiles).placement) == SPLIT
    model, _ = _model(tmp_path)
    assert model.serial is None
    assert evaluate(model, _row(model, SPLIT)).serial[0] == 0.0


def test_the_per_batch_part_is_shared_by_a_batchs_items(tmp_path: Path) -> None:
    model, _ = _model(tmp_path, serial_us_per_item=30.0, serial_us_per_batch=640.0)
    batch = load_pipeline(ROOT / "pipelines" / "resnet50.yaml").batch_max_size
    m = evaluate(model, _row(model, SPLIT))
    assert m.serial[0] == pytest.approx((30.0 + 640.0 / batch) * 1e-3)


def test_every_host_stage_pays_its_own_serial_time_and_the_gpu_none(tmp_path: Path) -> None:
    model, _ = _model(tmp_path, serial_us_per_item=100.0, serial_us_per_batch=0.0)
    host_gpu_host = {"decode": "cpu", "resize": "gpu0", "crop": "cpu", "norm": "cpu"}
    m = evaluate(model, np.vstack([_row(model, p) for p in (host_gpu_host, SPLIT, ALL_GPU)]))
    assert m.serial.tolist() == pytest.approx([0.2, 0.1, 0.0])
    assert m.bottleneck[1] == pytest.approx(0.1)  # the split: the interpreter, not the GPU


def test_the_serial_cap_is_throughput_only_not_host_cpu(tmp_path: Path) -> None:
    """The serial time is CPU time the host's figures already count: only the cap is new."""
    with_cap, _ = _model(tmp_path, serial_us_per_item=100.0, serial_us_per_batch=0.0)
    without, _ = _model(tmp_path)
    a = figures(with_cap, evaluate(with_cap, _row(with_cap, SPLIT)))
    b = figures(without, evaluate(without, _row(without, SPLIT)))
    assert a["host_cpu_ms_per_item"] == b["host_cpu_ms_per_item"]
    assert a["latency_ms"] == b["latency_ms"]
    assert a["throughput_per_s"] < b["throughput_per_s"]


def test_the_serial_term_round_trips_and_an_older_profile_still_loads(tmp_path: Path) -> None:
    p = _profile("cpu", CPU_MS, serial_us_per_item=42.5, serial_us_per_batch=300.0)
    p.save(tmp_path / "new.json")
    doc = json.loads((tmp_path / "new.json").read_text())
    assert doc["runtime"] == {"serial_us_per_item": 42.5, "serial_us_per_batch": 300.0}
    back = load_profile(tmp_path / "new.json")
    assert (back.serial_us_per_item, back.serial_us_per_batch) == (42.5, 300.0)
    doc["version"] = 3  # measured before the serial term was: read, without it
    doc["runtime"] = {"host_us_per_item": 80.0, "agent_us_per_item": 16.0}
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_profile(tmp_path / "old.json")
    assert old.serial_us_per_item is None and old.serial_us_per_batch is None
    assert old.runtime_us_per_item == 80.0


def test_half_of_the_serial_pair_is_refused(tmp_path: Path) -> None:
    doc = _profile("cpu", CPU_MS).to_json()
    doc["runtime"] = {"serial_us_per_item": 42.5}
    (tmp_path / "half.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="'serial_us_per_item' without 'serial_us_per_batch'"):
        load_profile(tmp_path / "half.json")


def test_fit_serial_recovers_per_item_and_per_batch_parts() -> None:
    from nicoffload.profiling_serial import fit_serial

    assert fit_serial([(64, 40.0 + 320.0 / 64), (8, 40.0 + 320.0 / 8)]) == pytest.approx(
        (40.0, 320.0)
    )
    # a smaller batch measured cheaper (noise): no per-batch part, the mean per item
    assert fit_serial([(64, 50.0), (8, 40.0)]) == pytest.approx((45.0, 0.0))


def test_a_gpu_stages_host_side_python_shares_the_same_interpreter(tmp_path: Path) -> None:
    """The GPU's batches are fed and handed on by the host process: its measured serial time
    adds to the host stages' (and caps all-GPU too)."""
    pipeline, topo, profiles = _case(tmp_path, serial_us_per_item=30.0, serial_us_per_batch=0.0)
    profiles[1] = _profile("gpu", GPU_MS, serial_us_per_item=50.0, serial_us_per_batch=0.0)
    split = plan_placement(pipeline, SPLIT, topo, profiles)
    assert split.predicted.throughput_per_s == pytest.approx(1e3 / 0.080, rel=1e-6)
    plan = plan_for(pipeline, topo, profiles, explain=True)
    assert dict(plan.placement) == ALL_GPU  # the GPU's 0.060 ms, over its own 0.050 serial
    assert plan.predicted.throughput_per_s == pytest.approx(1e3 / 0.060, rel=1e-3)
    assert plan.explain["host_process"]["load_ms_per_item"] == pytest.approx(0.050)


def test_a_cpu_that_does_not_run_the_session_has_no_share_of_its_interpreter(
    tmp_path: Path,
) -> None:
    topo = tmp_path / "two.yaml"
    topo.write_text(
        "name: two\ningress: cpu\ndevices:\n  cpu: {kind: cpu, cores: 8}\n"
        "  cpu1: {kind: cpu, cores: 8}\nlinks:\n  - {between: [cpu, cpu1], transport: tcp, bandwidth: 10Gb/s}\n"
    )
    topology = load_topology(topo)
    prof = _profile("cpu", CPU_MS, serial_us_per_item=100.0, serial_us_per_batch=0.0)
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    model = build_model(
        pipeline, topology, resolve_profiles(topology, prof), Catalog.from_registry()
    )
    assert model.serial.tolist() == [pytest.approx([0.1, 0.0])] * 2  # both paths


def test_each_placement_pays_the_serial_time_of_the_runtime_path_that_runs_it(
    tmp_path: Path,
) -> None:
    """GPU -> host runs on the general path (`runtime.chain`), host -> GPU on the fast path
    (`runtime.executor`): each is priced by its own measured figures."""
    from nicoffload.planner.evaluate import fast_path

    model, _ = _model(
        tmp_path,
        serial_us_per_item=100.0,
        serial_us_per_batch=0.0,
        serial_general_us_per_item=20.0,
        serial_general_us_per_batch=0.0,
    )
    host_then_gpu = {"decode": "cpu", "resize": "cpu", "crop": "gpu0", "norm": "gpu0"}
    rows = np.vstack([_row(model, p) for p in (SPLIT, host_then_gpu, ALL_GPU)])
    assert fast_path(model, rows).tolist() == [False, True, True]
    assert evaluate(model, rows).serial.tolist() == pytest.approx([0.020, 0.100, 0.0])


def test_the_runtime_paths_are_told_apart_as_the_runtime_tells_them(tmp_path: Path) -> None:
    import itertools

    from nicoffload.planner.evaluate import fast_path
    from nicoffload.planner.plan import Plan, stages_for
    from nicoffload.runtime.chain import fast_path as runtime_fast_path

    pipeline, _, profiles = _case(tmp_path)
    topo = tmp_path / "three.yaml"
    topo.write_text(
        TOPOLOGY.replace(
            "  gpu0: {kind: gpu}\n", "  gpu0: {kind: gpu}\n  dpu0: {kind: dpu, cores: 8}\n"
        )
        + "  - {between: [cpu, dpu0], transport: tcp, bandwidth: 100Gb/s}\n"
    )
    topology = load_topology(topo)
    model = build_model(
        pipeline, topology, resolve_profiles(topology, profiles), Catalog.from_registry()
    )
    assert set(model.kinds) == {"cpu", "dpu", "gpu"}
    nodes = list(model.nodes)

    for devices in itertools.product(model.devices, repeat=len(nodes)):
        placement = dict(zip(nodes, devices, strict=True))
        stages, transfers = stages_for(pipeline, placement)
        plan = Plan(pipeline.name, placement, stages, transfers)
        assert fast_path(model, _row(model, placement))[0] == runtime_fast_path(plan), placement


def test_a_dpu_stage_on_the_general_path_holds_the_host_process_too(tmp_path: Path) -> None:
    """After a GPU stage a DPU stage runs on the general path: the host process hands its rows
    to the agent and puts what comes back into the batch, row by row; it pays the host's
    general figure. Without it the planner moved normalize off a busy GPU onto the DPU for
    0.35% less GPU load on the H200 host and was 3.4x off (predicted 17,205, ran at 5,028)."""
    pipeline, _, profiles = _case(
        tmp_path,
        serial_us_per_item=10.0,
        serial_us_per_batch=0.0,
        serial_general_us_per_item=100.0,
        serial_general_us_per_batch=0.0,
    )
    profiles.append(_profile("dpu", {op: ms / 4 for op, ms in CPU_MS.items()}))
    topo = tmp_path / "three.yaml"
    topo.write_text(
        TOPOLOGY.replace(
            "  gpu0: {kind: gpu}\n", "  gpu0: {kind: gpu}\n  dpu0: {kind: dpu, cores: 8}\n"
        )
        + "  - {between: [cpu, dpu0], transport: tcp, bandwidth: 100000Gb/s, latency: 1us}\n"
    )
    gpu_then_dpu = {"decode": "gpu0", "resize": "gpu0", "crop": "gpu0", "norm": "dpu0"}
    split = plan_placement(pipeline, gpu_then_dpu, str(topo), profiles)
    assert split.predicted.throughput_per_s == pytest.approx(1e3 / 0.100, rel=1e-6)
    plan = plan_for(pipeline, str(topo), profiles)
    assert dict(plan.placement) == ALL_GPU
