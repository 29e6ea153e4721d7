"""The planner prices a transfer as the runtime moves it: per byte and per batch at each CPU end."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.graph import load_pipeline
from nicoffload.planner import plan_for

ROOT = Path(__file__).resolve().parents[2]

TOPOLOGY = """\
name: t
ingress: cpu
egress: cpu
devices:
  cpu: {kind: cpu, cores: 4, profile: x86-server}
  dpu0: {kind: dpu, cores: 8, profile: x86-server}
links:
  - {between: [dpu0, cpu], transport: tcp, bandwidth: 100Gb/s, cpu_ns_per_byte: NS, cpu_us_per_batch: US}
"""


def _host_cpu(tmp_path: Path, ns: float, us: float, batch: int) -> float:
    """The predicted host CPU per item of resnet50 with every node pinned to the DPU."""
    text = (ROOT / "pipelines" / "resnet50.yaml").read_text()
    text = text.replace("max_size: 64", f"max_size: {batch}")
    text += "placement: {decode: [dpu], resize: [dpu], crop: [dpu], norm: [dpu]}\n"
    pipe = tmp_path / f"p{batch}.yaml"
    pipe.write_text(text)
    topo = tmp_path / f"t{ns}-{us}.yaml"
    topo.write_text(TOPOLOGY.replace("NS", str(ns)).replace("US", str(us)))
    plan = plan_for(load_pipeline(pipe), str(topo))
    assert set(plan.placement.values()) == {"dpu0"}
    return plan.predicted.host_cpu_ms_per_item


def test_each_batch_costs_the_host_its_share_and_each_byte_its_price(tmp_path: Path) -> None:
    base = _host_cpu(tmp_path, 0.0, 0.0, 16)
    # the JPEG goes to the DPU and the normalized crop (3x224x224 fp16) comes back: two batches
    # cross, each costing the host end 320 us, shared by the batch's 16 items
    assert _host_cpu(tmp_path, 0.0, 320.0, 16) - base == pytest.approx(2 * 0.320 / 16, rel=1e-6)
    assert _host_cpu(tmp_path, 0.0, 320.0, 64) - base == pytest.approx(2 * 0.320 / 64, rel=1e-6)
    crop, jpeg = 3 * 224 * 224 * 2, 110_000
    assert _host_cpu(tmp_path, 1.0, 0.0, 16) - base == pytest.approx((crop + jpeg) * 1e-6, rel=1e-3)


def test_the_host_runtimes_own_cpu_per_item_is_in_every_plans_figures(tmp_path: Path) -> None:
    """The profile's measured runtime overhead is added to the host's load: host CPU per item
    and, when the host is the bottleneck, throughput."""
    import json

    from nicoffload.profiles import Profile, load_profile

    shipped = load_profile(ROOT / "nicoffload" / "data" / "profiles" / "x86-server.json")
    doc = Profile(
        "cpu", shipped.kernels, shipped.links, method="measured: test", runtime_us_per_item=250.0
    ).to_json()
    assert doc["runtime"] == {"host_us_per_item": 250.0}
    (tmp_path / "with.json").write_text(json.dumps(doc))
    assert load_profile(tmp_path / "with.json").runtime_us_per_item == 250.0
    topo = tmp_path / "host.yaml"
    for name, profile in (("without", "x86-server"), ("with", str(tmp_path / "with.json"))):
        topo.write_text(
            f"name: h\ningress: cpu\ndevices:\n  cpu: {{kind: cpu, cores: 1, profile: {profile}}}\n"
        )
        plan = plan_for(load_pipeline(ROOT / "pipelines" / "resnet50.yaml"), str(topo))
        if name == "without":
            before = plan.predicted
        else:
            after = plan.predicted
    assert after.host_cpu_ms_per_item - before.host_cpu_ms_per_item == pytest.approx(0.25, abs=1e-5)
    assert 1e3 / after.throughput_per_s - 1e3 / before.throughput_per_s == pytest.approx(
        0.25, rel=1e-3
    )
