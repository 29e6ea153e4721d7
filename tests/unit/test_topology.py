"""Topology files: what they mean, and every mistake reported at its file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.errors import TopologyError
from nicoffload.topology import (
    load_topology,
    local_topology,
    parse_rate,
    parse_size,
    parse_time_ms,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "pipelines" / "topologies"

GOOD = """\
name: t
ingress: dpu0
devices:
  cpu: {kind: cpu, cores: 8, memory: 64GiB}
  dpu0: {kind: dpu, cores: 16, profile: bluefield3-arm}
  gpu0: {kind: gpu}
links:
  - {between: [dpu0, cpu], transport: rdma, bandwidth: 400Gb/s, latency: 3us}
  - {between: [cpu, gpu0], transport: pcie, bandwidth: 64GB/s}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    return path


def test_a_topology_file_gives_devices_links_and_ingress(tmp_path: Path) -> None:
    topo = load_topology(_write(tmp_path, GOOD))
    assert topo.ids == ("cpu", "dpu0", "gpu0")
    assert topo.ingress == "dpu0" and topo.egress == "gpu0"
    cpu = topo.device("cpu")
    assert (cpu.cores, cpu.capacity, cpu.memory) == (8, 8.0, 64 * 2**30)
    assert topo.device("gpu0").capacity == 1.0
    rdma = topo.links[0]
    assert rdma.bandwidth == pytest.approx(50e9) and rdma.latency_ms == pytest.approx(0.003)
    assert rdma.cpu_ns_per_byte == 0.0 and rdma.cpu_us_per_batch == 0.0
    assert topo.device("dpu0").profile.endswith("bluefield3-arm.json")


def test_a_link_may_say_what_it_costs_the_cpu_per_byte_and_per_batch(tmp_path: Path) -> None:
    text = GOOD.replace(
        "latency: 3us}", "latency: 3us, cpu_ns_per_byte: 0.5, cpu_us_per_batch: 12}"
    )
    link = load_topology(_write(tmp_path, text)).links[0]
    assert (link.cpu_ns_per_byte, link.cpu_us_per_batch) == (0.5, 12.0)


def test_a_route_without_a_direct_link_goes_through_the_host(tmp_path: Path) -> None:
    topo = load_topology(_write(tmp_path, GOOD))
    assert [h.name for h in topo.route("dpu0", "gpu0")] == ["dpu0->cpu", "cpu->gpu0"]
    assert topo.route("cpu", "cpu") == ()


@pytest.mark.parametrize(
    ("text", "value"),
    [("400Gb/s", 50e9), ("25 Gb/s", 3.125e9), ("64GB/s", 64e9), ("800MB/s", 800e6), (100, 12.5e9)],
)
def test_rates_are_read_in_bytes_per_second(text, value) -> None:
    assert parse_rate(text) == pytest.approx(value)


def test_times_and_sizes_have_units() -> None:
    assert parse_time_ms("5us") == pytest.approx(0.005)
    assert parse_time_ms("2 ms") == 2.0 and parse_time_ms(0.5) == 0.5
    assert parse_size("32GiB") == 32 * 2**30 and parse_size("1GB") == 10**9
    assert parse_rate("fast") is None and parse_time_ms("soon") is None


@pytest.mark.parametrize(
    ("replace", "by", "at", "message"),
    [
        ("kind: dpu, cores: 16", "kind: npu, cores: 16", "npu", "unknown kind 'npu'"),
        ("cores: 8,", "cores: -1,", "-1", "'cores' must be a positive integer"),
        ("memory: 64GiB", "memory: lots", "lots", "'memory' must be a size"),
        ("[dpu0, cpu]", "[dpu0, cpux]", "cpux", "unknown device 'cpux' (did you mean 'cpu'?)"),
        ("transport: rdma,", "transport: rmda,", "rmda", "unknown transport 'rmda'"),
        ("bandwidth: 64GB/s", "bandwidth: quick", "quick", "'bandwidth' must be a rate"),
        ("latency: 3us", "latency: soon", "soon", "'latency' must be a time"),
        ("latency: 3us", "latency: 3us, cpu_us_per_batch: -5", "-5", "'cpu_us_per_batch'"),
        ("latency: 3us", "latency: 3us, cpu_ns_per_byte: .nan", ".nan", "a finite number"),
        ("ingress: dpu0", "ingress: dpu9", "dpu9", "unknown device 'dpu9'"),
        ("gpu0: {kind: gpu}", "gpu0: {kind: gpu, colour: red}", "colour", "unknown key 'colour'"),
        ("profile: bluefield3-arm", "profile: bluefield9", "bluefield9", "profile 'bluefield9'"),
        ("  dpu0:", "  arm0:", "arm0", "must start with its kind"),
    ],
)
def test_each_mistake_is_reported_at_its_line_and_column(
    tmp_path: Path, replace: str, by: str, at: str, message: str
) -> None:
    assert replace in GOOD
    text = GOOD.replace(replace, by)
    path = _write(tmp_path, text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if by.strip() in ln)
    col = text.splitlines()[line - 1].index(at) + 1
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}:{line}:{col}: "), str(info.value)
    assert message in str(info.value)
    assert info.value.exit_code == 2


def test_a_bare_bandwidth_number_is_gigabits_per_second(tmp_path: Path) -> None:
    topo = load_topology(_write(tmp_path, GOOD.replace("bandwidth: 400Gb/s", "bandwidth: 400")))
    assert topo.links[0].bandwidth == pytest.approx(50e9)


def test_a_device_with_no_path_to_the_ingress_is_refused(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        GOOD.replace("  - {between: [cpu, gpu0], transport: pcie, bandwidth: 64GB/s}\n", ""),
    )
    with pytest.raises(TopologyError, match=r":6:3: device 'gpu0' has no link path to the ingress"):
        load_topology(path)


def test_two_links_between_the_same_devices_are_refused(tmp_path: Path) -> None:
    path = _write(
        tmp_path, GOOD + "  - {between: [cpu, dpu0], transport: tcp, bandwidth: 10Gb/s}\n"
    )
    with pytest.raises(
        TopologyError,
        match=r":10:5: link: a second link between 'cpu' and 'dpu0' \(first at line 8\)",
    ):
        load_topology(path)


def test_gpudirect_needs_a_gpu(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace("transport: rdma,", "transport: rdma-gpudirect,"))
    with pytest.raises(TopologyError, match="rdma-gpudirect needs a GPU"):
        load_topology(path)


@pytest.mark.parametrize("name", ["bluefield3-h100", "bluefield2-a100", "host-only", "edge-25g"])
def test_the_example_topologies_load(name: str) -> None:
    topo = load_topology(EXAMPLES / f"{name}.yaml")
    assert topo.name == name
    assert all(d.profile for d in topo.devices)


def test_the_local_machine_has_a_host_cpu_and_an_emulated_dpu_sharing_its_cores() -> None:
    import os

    topo = local_topology(gpu=False)
    n = len(os.sched_getaffinity(0))
    assert topo.device("cpu").kind == "cpu"
    if n > 1:
        dpu = topo.device("dpu0")
        assert dpu.emulated and dpu.kind == "dpu"
        assert topo.device("cpu").cores + dpu.cores == n
        # the agent's outputs come over shared memory, what the host sends it over its tcp
        assert [h.link.transport for h in topo.route("dpu0", "cpu")] == ["shm"]
        assert [h.link.transport for h in topo.route("cpu", "dpu0")] == ["tcp"]
        # the items of `run` are in this process: moving them to the DPU is priced
        assert topo.ingress == "cpu"
        assert local_topology(gpu=False, ingress="dpu0").ingress == "dpu0"  # serving
    assert topo.egress == "cpu"


def test_the_local_gpu_appears_only_when_cuda_works() -> None:
    assert "gpu0" in local_topology(gpu=True).ids
    assert "gpu0" not in local_topology(gpu=False).ids


def test_the_local_dpus_link_is_chosen_by_argument_or_environment(monkeypatch) -> None:
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no emulated DPU")
    as_tcp = local_topology(gpu=False, dpu_link="tcp")
    assert [h.link.transport for h in as_tcp.route("dpu0", "cpu")] == ["tcp"]
    assert as_tcp.links[0].reverse is None
    monkeypatch.setenv("NICOFFLOAD_DPU_LINK", "tcp")
    assert local_topology(gpu=False).route("dpu0", "cpu")[0].link.transport == "tcp"
    monkeypatch.setenv("NICOFFLOAD_DPU_LINK", "rdma")
    with pytest.raises(TopologyError, match="expected one of shm, tcp"):
        local_topology(gpu=False)
    assert "dpu0" not in local_topology(gpu=False, emulate_dpu=False).ids  # no DPU: no link


def test_a_plans_explanation_gives_each_hop_its_own_directions_bandwidth() -> None:
    import dataclasses
    import os

    from nicoffload.graph import load_pipeline
    from nicoffload.planner import plan_for

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no emulated DPU")
    topo = local_topology(gpu=False, dpu_link="shm")
    (link,) = topo.links
    slow = dataclasses.replace(link.reverse, bandwidth=1e9)  # cpu -> dpu0: 8 Gb/s
    topo = dataclasses.replace(
        topo, links=(dataclasses.replace(link, bandwidth=8e9, reverse=slow),)
    )
    pipeline = load_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "resnet50.yaml")
    plan = plan_for(pipeline, topo, objective="host-cpu", explain=True)
    links = plan.explain["links"]
    assert links["cpu->dpu0"]["bandwidth_gbps"] == 8.0
    if "dpu0->cpu" in links:
        assert links["dpu0->cpu"]["bandwidth_gbps"] == 64.0
