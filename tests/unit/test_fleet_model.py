"""A server's model under a policy is the planner's cost model of that policy's plan, and a
fleet's figures are its kinds' representatives scaled by their counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.fleet import load_fleet, simulate
from nicoffload.fleet.model import stream_model
from nicoffload.graph import load_pipeline
from nicoffload.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml"
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(PIPELINE)


@pytest.fixture(scope="module")
def topology():
    return load_topology(TOPOLOGY)


def full_batch_ms(model, station: str) -> float:
    """A station's ms per item in full batches, over every visit of the route."""
    b = model.batch_max_size
    return sum(v.ms + v.batch_ms / b for v in model.route.visits if v.station == station)


def test_all_host_puts_every_node_on_the_host(pipeline, topology) -> None:
    m = stream_model(pipeline, topology, (), "all-host")
    assert set(m.placement.values()) == {"cpu"}


@pytest.mark.parametrize("policy", ["all-host", "planner", "min-host-cpu"])
def test_in_full_batches_the_host_costs_what_the_planner_predicts(pipeline, topology, policy):
    m = stream_model(pipeline, topology, (), policy)
    host = sum(full_batch_ms(m, s) for s in m.host)
    assert host == pytest.approx(m.predicted.host_cpu_ms_per_item, rel=1e-6, abs=1e-9)


def test_the_busiest_station_in_full_batches_is_the_planners_bottleneck(pipeline, topology):
    m = stream_model(pipeline, topology, (), "planner")
    rates = {
        s: m.capacity[s] / full_batch_ms(m, s) * 1e3 for s in {v.station for v in m.route.visits}
    }
    assert min(rates.values()) == pytest.approx(m.predicted.throughput_per_s, rel=1e-3)


def test_host_assist_gives_the_host_a_copy_of_the_pipeline(pipeline, topology) -> None:
    m = stream_model(pipeline, topology, (), "planner+assist")
    assert m.assist_station == "dpu0"
    assert {v.station for v in m.assist_route.visits} & {"cpu"}


def fleet_file(tmp_path: Path, count: int, rate: float, topology: Path = TOPOLOGY) -> Path:
    path = tmp_path / f"fleet-{count}.yaml"
    path.write_text(
        f"servers:\n  bf3: {{count: {count}, topology: {topology}}}\n"
        f"mix:\n  - {{pipeline: {PIPELINE}, rate: {rate}}}\n"
    )
    return path


def test_a_kinds_servers_scale_its_representative(tmp_path: Path) -> None:
    one = simulate(load_fleet(fleet_file(tmp_path, 1, 3000)), ["planner"], 2.0)
    many = simulate(load_fleet(fleet_file(tmp_path, 1000, 3_000_000)), ["planner"], 2.0)
    (a,), (b,) = one.policies, many.policies
    assert b.goodput_per_s == pytest.approx(1000 * a.goodput_per_s)
    assert b.host_cpu_cores == pytest.approx(1000 * a.host_cpu_cores, rel=1e-4)  # rounded
    assert (b.p50_ms, b.p99_ms) == (a.p50_ms, a.p99_ms)


def test_all_host_saves_no_host_cpu_and_the_planner_saves_some(tmp_path: Path) -> None:
    result = simulate(load_fleet(fleet_file(tmp_path, 10, 30000)), ["all-host", "planner"], 2.0)
    host, planned = result.policies
    assert host.host_cpu_saved_cores == 0.0
    assert planned.host_cpu_saved_cores > 0 and 0 < planned.host_cpu_saved_share <= 1


def test_all_host_saves_nothing_at_a_rate_whose_batches_are_small(tmp_path: Path) -> None:
    # edge-25g: requests reach the host over tcp, whose per-batch CPU each small batch pays
    edge = ROOT / "pipelines" / "topologies" / "edge-25g.yaml"
    result = simulate(load_fleet(fleet_file(tmp_path, 1, 50, edge)), ["all-host"], 4.0)
    (host,) = result.policies
    assert host.streams[0].host_cpu_ms_per_item > host.streams[0].predicted_host_cpu_ms_per_item
    assert host.host_cpu_saved_cores == 0.0


def test_a_fleet_offered_more_than_it_can_serve_is_saturated(tmp_path: Path) -> None:
    (p,) = simulate(load_fleet(fleet_file(tmp_path, 1, 20000)), ["all-host"], 2.0).policies
    assert p.saturated and p.goodput_per_s < p.offered_per_s
