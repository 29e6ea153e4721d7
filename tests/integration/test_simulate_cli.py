"""`nicoffload simulate` as a user runs it: one JSON document on stdout, mistakes as exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "pipelines" / "fleets" / "example-1000.yaml"


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nicoffload", "simulate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_json_gives_each_policys_figures_for_the_whole_fleet() -> None:
    out = simulate(EXAMPLE, "--policy", "all-host,planner", "--duration", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert (doc["fleet"], doc["servers"], doc["duration_s"]) == ("example-1000", 1000, 1.0)
    assert [p["policy"] for p in doc["policies"]] == ["all-host", "planner"]
    for p in doc["policies"]:
        assert p["goodput_per_s"] > 0 and p["p50_ms"] <= p["p99_ms"]
        kinds = {(s["kind"], s["pipeline"]) for s in p["streams"]}
        assert len(kinds) == 4  # two server kinds, two pipelines
        assert sum(s["servers"] for s in p["streams"]) == 2 * 1000
    host, planner = doc["policies"]
    assert host["host_cpu_saved_cores"] == 0.0 and planner["host_cpu_saved_cores"] > 0


def test_a_mistake_in_the_fleet_file_exits_2_naming_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text(EXAMPLE.read_text().replace("count: 800", "count: many"))
    out = simulate(bad, "--json")
    assert out.returncode == 2 and out.stdout == ""
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "count: many" in t)
    assert f"{bad}:{line}:" in out.stderr and "'count' must be a positive integer" in out.stderr


def test_an_unknown_policy_exits_2_with_a_suggestion() -> None:
    out = simulate(EXAMPLE, "--policy", "planer")
    assert out.returncode == 2 and "did you mean 'planner'" in out.stderr


def test_plot_draws_the_policies_into_a_png(tmp_path: Path) -> None:
    png = tmp_path / "fleet.png"
    out = simulate(EXAMPLE, "--policy", "all-host", "--duration", "0.5", "--plot", png)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
