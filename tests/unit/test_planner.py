"""plan_for on real pipelines: costs from TensorSpecs, fusion, pins, memory, SLOs, and the Plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nicoffload.errors import PlanError
from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for
from nicoffload.planner.cost import Catalog, build_model, chain_work, effective_specs
from nicoffload.planner.evaluate import Goal, brute_force, evaluate
from nicoffload.planner.plan import Plan, single_device_plan
from nicoffload.planner.solve import resolve_profiles
from nicoffload.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = ROOT / "pipelines" / "topologies"
IMAGE_OPS = ("decode_image", "resize", "center_crop", "normalize", "tokenize")
FUSED = (
    ("resize", "center_crop", "normalize"),
    ("resize", "center_crop"),
    ("center_crop", "normalize"),
)
# The kernels that exist for x86 and Arm cores; GPU kernels are left out so that these tests
# speak about the DPU/host split whatever the GPU registry holds.
CPU_AND_DPU = Catalog(
    {op: frozenset({"cpu", "dpu"}) for op in IMAGE_OPS}, {"cpu": FUSED, "dpu": FUSED}
)


@pytest.fixture(scope="module")
def resnet():
    return load_pipeline(ROOT / "pipelines" / "resnet50.yaml")


def _pipeline(tmp_path: Path, extra: str) -> Path:
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text() + extra
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def _topology(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


def test_a_decode_followed_by_a_resize_is_costed_at_the_size_it_really_decodes(tmp_path) -> None:
    """A 2000x3000 photo for resnet50's 256: the kernel decodes it at 1/4 (1000x1500 leaves
    the resize 3x to shrink); tests/unit/test_dct_decoded_size.py checks against the kernel."""
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    path = tmp_path / "photo.yaml"
    path.write_text(text.replace("height: 375, width: 500", "height: 2000, width: 3000"))
    photo = load_pipeline(path)
    specs = effective_specs(photo)
    assert specs["decode"][1]["out"].typical_shape == (1000, 1500, 3)
    assert specs["resize"][0][0].typical_shape == (1000, 1500, 3)
    topo = load_topology(TOPOLOGIES / "bluefield3-h100.yaml")
    model = build_model(photo, topo, resolve_profiles(topo), CPU_AND_DPU)
    assert {r.label: r.nbytes for r in model.refs}["decode"] == 1000 * 1500 * 3


def test_a_stage_of_a_fused_chain_is_priced_as_the_fused_kernel(resnet) -> None:
    plan = plan_for(resnet, TOPOLOGIES / "host-only.yaml", catalog=CPU_AND_DPU)
    (stage,) = plan.stages
    topo = load_topology(TOPOLOGIES / "host-only.yaml")
    model = build_model(resnet, topo, resolve_profiles(topo), CPU_AND_DPU)
    fused = resolve_profiles(topo)["cpu"].kernel("resize+center_crop+normalize")
    expect = model.cost[0, 0] + fused.ms(chain_work(resnet, ["resize", "crop", "norm"]))
    assert stage.predicted_ms_per_item == pytest.approx(expect, rel=1e-5)
    assert stage.predicted_ms_per_item < model.cost[:, 0].sum()


def test_a_thin_link_makes_the_planner_cut_after_crop(resnet, tmp_path: Path) -> None:
    """Through a 25 Gb/s link the uint8 crop (150 KB) is cheaper than the decoded image (317 KB)
    or the float16 tensor (301 KB); a strong gateway does the rest, the host normalizes."""
    topo = _topology(
        tmp_path,
        """
devices:
  cpu: {kind: cpu, cores: 4}
  dpu0: {kind: dpu, cores: 64, profile: bluefield3-arm}
  gpu0: {kind: gpu}
links:
  - {between: [dpu0, cpu], transport: rdma, bandwidth: 25Gb/s}
  - {between: [cpu, gpu0], transport: pcie, bandwidth: 32GB/s}
""",
    )
    plan = plan_for(resnet, topo, catalog=CPU_AND_DPU, explain=True)
    assert [t.tensor for t in plan.transfers] == ["crop"]
    assert plan.transfers[0].bytes_per_item == 224 * 224 * 3
    assert plan.explain["bottleneck"]["resource"] == "dpu0->cpu"
    assert plan.explain["runner_up"]["reason"] == "link bytes"


def test_a_pin_is_obeyed(resnet, tmp_path: Path) -> None:
    p = load_pipeline(_pipeline(tmp_path, "placement: {decode: cpu, norm: [dpu]}\n"))
    plan = plan_for(p, TOPOLOGIES / "bluefield3-h100.yaml", catalog=CPU_AND_DPU)
    assert plan.placement["decode"] == "cpu" and plan.placement["norm"] == "dpu0"


def test_a_pin_to_a_device_without_the_kernel_names_the_node_and_the_line(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "placement:\n  decode: gpu\n")
    with pytest.raises(PlanError) as info:
        plan_for(load_pipeline(path), TOPOLOGIES / "bluefield3-h100.yaml", catalog=CPU_AND_DPU)
    assert str(info.value).startswith(f"{path}:17:11: node 'decode' is pinned to gpu, but gpu0: ")
    assert "op 'decode_image' has no gpu kernel (kernels exist for: cpu, dpu)" in str(info.value)
    assert info.value.exit_code == 2


def test_a_pin_to_a_device_the_topology_lacks_is_refused(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "placement: {crop: dpu}\n")
    with pytest.raises(
        PlanError,
        match=r":16:19: node 'crop' is pinned to dpu, but topology 'host-only' has no such device",
    ):
        plan_for(load_pipeline(path), TOPOLOGIES / "host-only.yaml", catalog=CPU_AND_DPU)


def test_an_unmeetable_latency_slo_names_the_slo_line_and_the_slowest_node(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "slo: {latency_ms: 0.2}\n")
    with pytest.raises(PlanError) as info:
        plan_for(load_pipeline(path), TOPOLOGIES / "bluefield3-h100.yaml", catalog=CPU_AND_DPU)
    message = str(info.value)
    assert message.startswith(
        f"{path}:16:19: no placement meets the latency SLO of 0.2 ms (slo.latency_ms)"
    )
    assert "node 'decode'" in message


def test_an_unreachable_throughput_floor_names_the_bottleneck(resnet) -> None:
    with pytest.raises(
        PlanError,
        match=r"no placement reaches 1e\+06 items/s \(--min-throughput\).*limited by dpu0, most of it node 'decode'",
    ):
        plan_for(
            resnet,
            TOPOLOGIES / "bluefield3-h100.yaml",
            catalog=CPU_AND_DPU,
            min_throughput_per_s=1e6,
        )


def test_a_throughput_floor_moves_work_off_the_dpu_under_the_host_cpu_objective(resnet) -> None:
    free = plan_for(
        resnet, TOPOLOGIES / "bluefield2-a100.yaml", objective="host-cpu", catalog=CPU_AND_DPU
    )
    assert set(free.placement.values()) == {"dpu0"} and free.predicted.host_cpu_ms_per_item == 0
    floor = free.predicted.throughput_per_s * 2
    fast = plan_for(
        resnet,
        TOPOLOGIES / "bluefield2-a100.yaml",
        objective="host-cpu",
        catalog=CPU_AND_DPU,
        min_throughput_per_s=floor,
    )
    assert fast.predicted.throughput_per_s >= floor * (1 - 1e-6)
    assert fast.predicted.host_cpu_ms_per_item > 0


def test_a_node_goes_where_its_buffers_fit(resnet, tmp_path: Path) -> None:
    text = (
        (TOPOLOGIES / "bluefield3-h100.yaml").read_text().replace("memory: 32GiB", "memory: 1MiB")
    )
    plan = plan_for(resnet, _topology(tmp_path, text), catalog=CPU_AND_DPU)
    assert "dpu0" not in plan.placement.values()


def test_buffers_that_fit_nowhere_are_a_plan_error(resnet, tmp_path: Path) -> None:
    text = (TOPOLOGIES / "host-only.yaml").read_text().replace("memory: 256GiB", "memory: 1MiB")
    with pytest.raises(PlanError, match=r"node .decode. needs .* MiB of batch buffers"):
        plan_for(resnet, _topology(tmp_path, text), catalog=CPU_AND_DPU)


def test_a_dag_is_planned_exactly_by_the_milp() -> None:
    clip = load_pipeline(ROOT / "pipelines" / "clip.yaml")
    topo = load_topology(TOPOLOGIES / "bluefield3-h100.yaml")
    plan = plan_for(clip, topo, catalog=CPU_AND_DPU)
    model = build_model(clip, topo, resolve_profiles(topo), CPU_AND_DPU)
    _best, truth = brute_force(model, Goal("throughput"))
    placed = np.array([topo.ids.index(plan.placement[n]) for n in model.nodes])
    assert evaluate(model, placed).bottleneck[0] == pytest.approx(truth.bottleneck[0], rel=1e-6)


def test_the_plan_predicts_stages_transfers_and_io_and_round_trips(resnet, tmp_path: Path) -> None:
    plan = plan_for(resnet, TOPOLOGIES / "bluefield3-h100.yaml", catalog=CPU_AND_DPU, explain=True)
    assert plan.ingress == "dpu0" and plan.egress == "gpu0"
    assert all(s.predicted_ms_per_item > 0 for s in plan.stages)
    assert all(t.predicted_ms_per_item > 0 and t.link for t in plan.transfers)
    assert [t.dst_stage for t in plan.io_transfers][-1] == "egress"
    assert plan.predicted.throughput_per_s == pytest.approx(
        1e3 / max(plan.loads.values()), rel=1e-4
    )
    steps = plan.explain["latency_path"]
    assert sum(s["ms"] for s in steps) == pytest.approx(plan.predicted.latency_ms, rel=1e-5)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    assert Plan.load(tmp_path / "plan.json").stage_of("decode").device == plan.placement["decode"]


def test_single_device_plans_still_work(resnet) -> None:
    plan = single_device_plan(resnet)
    assert Plan.from_json(plan.to_json()) == plan and plan.ingress is None


def test_without_a_topology_the_local_machine_is_planned(
    resnet, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(
        "NICOFFLOAD_PROFILES", str(tmp_path)
    )  # shipped estimates, not this machine's
    plan = plan_for(resnet, catalog=CPU_AND_DPU)
    assert plan.topology == "local" and set(plan.placement.values()) <= {"cpu", "dpu0"}
    assert any("x86-server" in n for n in plan.notes)
