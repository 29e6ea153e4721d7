"""Fleet files: what they mean, and every mistake reported at its file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest

from nicoffload.fleet import FleetError, load_fleet
from nicoffload.fleet.servers import server_topology

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "pipelines" / "fleets" / "example-1000.yaml"
TOPOLOGY = ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml"
PIPELINE = ROOT / "pipelines" / "resnet50.yaml"

GOOD = f"""\
name: f
duration: 2s
servers:
  bf3:
    count: 10
    topology: {TOPOLOGY}
    cores: {{cpu: 4}}
    nic: {{bandwidth: 100Gb/s, latency: 10us}}
    links:
      - {{between: [dpu0, cpu], bandwidth: 25Gb/s}}
mix:
  - {{pipeline: {PIPELINE}, rate: 5000/s, sizes: {{image: {{height: 480, width: 640}}}}}}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> FleetError:
    with pytest.raises(FleetError) as info:
        load_fleet(_write(tmp_path, text))
    return info.value


def test_a_fleet_file_gives_server_kinds_counts_and_the_mix(tmp_path: Path) -> None:
    fleet = load_fleet(_write(tmp_path, GOOD))
    (kind,) = fleet.servers
    assert (kind.name, kind.count, kind.cores) == ("bf3", 10, (("cpu", 4),))
    assert kind.nic.bandwidth == pytest.approx(12.5e9)
    assert kind.nic.latency_ms == pytest.approx(0.01)
    (demand,) = fleet.mix
    assert demand.rate_per_s == 5000 and demand.typical == {"image": {"height": 480, "width": 640}}
    assert (fleet.duration_s, fleet.count) == (2.0, 10)


def test_the_shipped_example_describes_1000_servers() -> None:
    assert load_fleet(EXAMPLE).count == 1000


def test_a_kinds_overrides_change_its_topology(tmp_path: Path) -> None:
    topo = server_topology(load_fleet(_write(tmp_path, GOOD)).servers[0])
    assert (topo.device("cpu").cores, topo.device("cpu").capacity) == (4, 4.0)
    link = next(k for k in topo.links if {k.a, k.b} == {"dpu0", "cpu"})
    assert link.bandwidth == pytest.approx(25e9 / 8)


def test_an_unknown_key_is_named_with_a_suggestion_at_its_line(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("    count: 10", "    cuont: 10"))
    assert (err.mark.line, err.mark.column) == (5, 5)
    assert "unknown key 'cuont'" in str(err) and "did you mean 'count'" in str(err)


def test_a_count_that_is_not_a_positive_integer_is_refused_at_its_value(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("count: 10", "count: 2.5"))
    assert (err.mark.line, err.mark.column) == (5, 12)
    assert "'count' must be a positive integer" in str(err)


def test_a_missing_topology_file_is_named_at_its_line(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace(str(TOPOLOGY), "nowhere.yaml"))
    assert err.mark.line == 6 and "no file 'nowhere.yaml'" in str(err)


def test_a_rate_without_a_number_says_what_would_be_right(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("rate: 5000/s", "rate: fast"))
    assert err.mark.line == 12 and "requests per second like 5000/s" in str(err)


def test_a_bad_nic_bandwidth_is_refused_at_its_value(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("bandwidth: 100Gb/s", "bandwidth: lots"))
    assert err.mark.line == 8 and "'bandwidth' must be a rate" in str(err)


def test_an_unknown_size_key_is_named(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("height: 480", "hieght: 480"))
    assert err.mark.line == 12 and "unknown key 'hieght'" in str(err)


def test_an_empty_mix_is_refused(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("mix:")] + "mix: []\n"
    assert "'mix' must be a list" in str(_error(tmp_path, text))


def test_a_link_override_between_devices_with_no_link_is_refused_at_it(tmp_path: Path) -> None:
    text = GOOD.replace("between: [dpu0, cpu]", "between: [dpu0, dpu9]")
    with pytest.raises(FleetError) as info:
        server_topology(load_fleet(_write(tmp_path, text)).servers[0])
    assert info.value.mark.line == 10 and "no link between dpu0 and dpu9" in str(info.value)


def test_cores_of_a_device_the_topology_lacks_are_refused(tmp_path: Path) -> None:
    text = GOOD.replace("cores: {cpu: 4}", "cores: {cpu9: 4}")
    with pytest.raises(FleetError) as info:
        server_topology(load_fleet(_write(tmp_path, text)).servers[0])
    assert "cores of 'cpu9'" in str(info.value) and info.value.mark.line == 4


def test_a_kind_without_a_count_is_refused_at_the_kind(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("    count: 10\n", ""))
    assert err.mark.line == 5 and "'count' is required" in str(err)


def test_a_bad_duration_is_refused_at_its_value(tmp_path: Path) -> None:
    err = _error(tmp_path, GOOD.replace("duration: 2s", "duration: soon"))
    assert (err.mark.line, err.mark.column) == (2, 11) and "a time like 10s" in str(err)


def test_a_server_kind_that_is_not_a_mapping_is_refused_at_it(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("  bf3:")] + "  bf3: 12\n" + GOOD[GOOD.index("mix:") :]
    err = _error(tmp_path, text)
    assert (err.mark.line, err.mark.column) == (4, 8) and "must be a mapping" in str(err)
