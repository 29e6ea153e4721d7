"""`nicoffload plan`: the table, --json in the DESIGN.md shape, --output, and exit code 2."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nicoffload.cli import build_app
from nicoffload.planner import cost
from nicoffload.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
RESNET = str(ROOT / "pipelines" / "resnet50.yaml")
TOPOLOGIES = ROOT / "pipelines" / "topologies"


@pytest.fixture(autouse=True)
def x86_and_arm_kernels_only(monkeypatch):
    """Plan with the kernels that exist for host and DPU cores; GPU kernels stay out, so these
    tests speak about the DPU/host split whatever the GPU registry holds."""
    real = cost.Catalog.from_registry

    def cpu_and_dpu() -> cost.Catalog:
        cat = real()
        single = {op: kinds - {"gpu"} for op, kinds in cat.single.items()}
        return cost.Catalog(single, {k: v for k, v in cat.fused.items() if k != "gpu"})

    if not real().kinds("decode_image") >= {"cpu", "dpu"}:
        pytest.skip("the image kernels for cpu and dpu are not registered")
    monkeypatch.setattr(cost.Catalog, "from_registry", staticmethod(cpu_and_dpu))


def _plan(*args: str) -> dict:
    result = CliRunner().invoke(build_app(), ["plan", RESNET, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_json_has_the_design_shape() -> None:
    doc = _plan("--topology", str(TOPOLOGIES / "bluefield3-h100.yaml"))
    assert set(doc["placement"]) == {"decode", "resize", "crop", "norm"}
    assert set(doc["predicted"]) == {"latency_ms", "throughput_per_s", "host_cpu_ms_per_item"}
    assert doc["stages"] and all("predicted_ms_per_item" in s for s in doc["stages"])
    assert "transfers" in doc and "io_transfers" in doc
    ex = doc["explain"]
    assert {"bottleneck", "devices", "links", "latency_path", "runner_up"} <= set(ex)
    assert ex["runner_up"]["why"] and ex["runner_up"]["lost_on"] in ("throughput", "latency")
    search = doc["search"]  # resnet50 is a chain: exact at once
    assert search["method"] == "dynamic programming" and search["gap"] == 0
    assert search["tie_break_gap"] == 0 and search["seconds"] >= 0 and search["time_limit_s"] == 20


def _slow_edge(tmp_path: Path, bandwidth: str = "5Gb/s", transport: str = "tcp") -> str:
    """The edge box of edge-25g.yaml with its uplink at `bandwidth`. At 5 Gb/s the JPEG alone
    is the box's busiest load, and every decoded tensor is larger than the JPEG (the 375x500
    photo decodes at full size: no exact DCT scale leaves the resize to 256 its 3x margin; even
    the 224x224 crop is 150 KB against 110 KB), so the link keeps work off the gateway. (At
    25 Gb/s, since decode is priced at the size really decoded, the runner-up that moves
    normalize to the gateway loses on host device time instead.)"""
    text = (TOPOLOGIES / "edge-25g.yaml").read_text()
    assert "bandwidth: 25Gb/s" in text
    path = tmp_path / f"edge-{bandwidth.split('G')[0]}g-{transport}.yaml"
    text = text.replace(
        "transport: tcp, bandwidth: 25Gb/s", f"transport: {transport}, bandwidth: 25Gb/s"
    )
    path.write_text(text.replace("bandwidth: 25Gb/s", f"bandwidth: {bandwidth}"))
    return str(path)


def test_the_edge_box_and_the_bluefield3_server_place_resnet_differently_for_a_reason(
    tmp_path: Path,
) -> None:
    edge = _plan("--topology", _slow_edge(tmp_path))
    bf3 = _plan("--topology", str(TOPOLOGIES / "bluefield3-h100.yaml"))
    assert edge["placement"] != bf3["placement"]
    # On the BlueField-3 server the limit is device time: the link is nowhere near busy.
    assert bf3["explain"]["bottleneck"]["kind"] == "device"
    assert bf3["explain"]["runner_up"]["reason"] == "device time"
    assert all(
        link["load_ms_per_item"] < bf3["explain"]["bottleneck"]["load_ms_per_item"] / 4
        for link in bf3["explain"]["links"].values()
    )
    # On the edge box the alternative that offloads to the gateway loses on link bytes.
    assert edge["explain"]["bottleneck"]["kind"] == "link"
    ru = edge["explain"]["runner_up"]
    assert "dpu0" in ru["placement"].values() and "dpu0" not in edge["placement"].values()
    assert ru["reason"] == "link bytes"
    assert ru["binding"]["bandwidth_gbps"] == 5
    edge_link = edge["explain"]["links"]["dpu0->cpu"]["bytes_per_item"]
    assert edge_link < ru["binding"]["bytes_per_item"]
    # And the link is the reason: with a 400 Gb/s link the same box offloads to the gateway,
    # moving more bytes per item than the 5 Gb/s link carries at the edge plan's rate. Over RDMA,
    # and over TCP too: with GMAC frames a received byte costs the host 0.3 ns of CPU (it was
    # 1.0 with HMAC-SHA256, when the larger decoded tensor cost more to receive than the decode).
    for transport in ("rdma", "tcp"):
        offload = _plan("--topology", _slow_edge(tmp_path, "400Gb/s", transport))
        assert "dpu0" in offload["placement"].values(), transport
        busiest = max(
            link["bytes_per_item"]
            for link in offload["explain"]["links"].values()
            if "dpu0" in link["resource"]
        )
        assert busiest * 8 / 5e9 * 1e3 > edge["explain"]["bottleneck"]["load_ms_per_item"]


def test_plan_prints_placement_breakdown_loads_and_the_runner_up(tmp_path: Path) -> None:
    result = CliRunner().invoke(build_app(), ["plan", RESNET, "--topology", _slow_edge(tmp_path)])
    assert result.exit_code == 0, result.output
    for part in (
        "placement",
        "stages and transfers",
        "load per item",
        "bottleneck",
        "predicted:",
        "runner-up",
        "lost on throughput (link bytes)",
        "estimate",
        "search: dynamic programming,",
        "proven optimal",
    ):
        assert part in result.stdout, part


def test_a_placement_too_wide_for_the_terminal_is_one_row_per_node(tmp_path: Path) -> None:
    """Every device a column while that fits; past the width, each node's device and the
    cheapest other one (a 16-device server would print truncated cells otherwise)."""
    from rich.console import Console

    from nicoffload.cli.plan import render

    out = tmp_path / "plan.json"
    args = ["plan", RESNET, "--topology", str(TOPOLOGIES / "bluefield3-h100.yaml"), "-o", str(out)]
    assert CliRunner().invoke(build_app(), args).exit_code == 0
    plan = Plan.load(out)
    nodes = plan.explain["nodes"]

    def text(width: int) -> str:  # printed wide, so that only render's choice differs
        console = Console(width=200, record=True, file=io.StringIO())
        for part in render(plan, width):
            console.print(part)
        return console.export_text()

    wide = text(200)
    assert "* chosen" in wide
    for info in nodes.values():
        assert all(d in wide for d in info["core_ms_by_device"])
    narrow = text(30)
    assert "* chosen" not in narrow and "cheapest other" in narrow
    for name, info in nodes.items():
        costs = {d: v for d, v in info["core_ms_by_device"].items() if not isinstance(v, str)}
        other = min((v, d) for d, v in costs.items() if d != info["device"])
        row = next(line for line in narrow.splitlines() if f" {name} " in line)
        assert info["device"] in row and other[1] in row and f"{other[0]:.4f}" in row, row


def test_plan_output_is_a_plan_that_run_can_load(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        build_app(),
        ["plan", RESNET, "--topology", str(TOPOLOGIES / "host-only.yaml"), "--output", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert Plan.load(out).placement == {
        "decode": "cpu",
        "resize": "cpu",
        "crop": "cpu",
        "norm": "cpu",
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--objective", "cheapest"], "--objective must be one of throughput, latency, host-cpu"),
        (
            ["--max-latency-ms", "0.05"],
            "no placement meets the latency SLO of 0.05 ms (--max-latency-ms)",
        ),
        (["--min-throughput", "-3"], "--min-throughput must be a positive number"),
    ],
)
def test_a_wrong_request_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(
        build_app(), ["plan", RESNET, "--topology", str(TOPOLOGIES / "host-only.yaml"), *args]
    )
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_a_bad_topology_file_exits_2_at_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("devices:\n  cpu: {kind: cpu, cores: many}\n")
    result = CliRunner().invoke(build_app(), ["plan", RESNET, "--topology", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2:27: device 'cpu': 'cores' must be a positive integer" in result.stderr


def test_transfers_into_the_gpu_that_land_alike_are_one_line() -> None:
    """A 200-node DAG has dozens of DPU -> GPU transfers: one line (and one warning) per link,
    landing and reason, naming the first few; a lone transfer keeps its own line."""
    from nicoffload.cli.plan import landing_lines

    def row(pair: str, link: str, warning: str | None = None) -> dict:
        r = {"transfer": pair, "link": link, "destination": "pinned-host", "reason": "why"}
        return {**r, "warning": warning} if warning else r

    landing = [
        row(f"s{i}-dpu0 -> s9-gpu0", "rdma-gpudirect", "no GPUDirect here") for i in (1, 2, 3, 4)
    ]
    landing.insert(1, row("s1-dpu0 -> s9-gpu0", "rdma-gpudirect", "no GPUDirect here"))
    landing.append(row("s5-dpu1 -> s9-gpu0", "rdma+pcie"))
    assert landing_lines(landing) == [
        (
            "into the GPU, 5 transfers (s1-dpu0 -> s9-gpu0, s2-dpu0 -> s9-gpu0, s3-dpu0 -> "
            "s9-gpu0 and 1 more) over rdma-gpudirect: pinned-host (why)",
            "no GPUDirect here",
        ),
        ("into the GPU, s5-dpu1 -> s9-gpu0 over rdma+pcie: pinned-host (why)", None),
    ]


@pytest.mark.parametrize(
    "search, says",
    [
        ({"gap": 0.0, "tie_break_gap": 0.0}, "proven optimal"),
        ({"gap": 0.02, "tie_break_gap": None}, "proven within 2.0% of the optimum (time limit)"),
        ({"gap": None, "tie_break_gap": None}, "no bound proven (time limit)"),
        (
            {"gap": 0.0, "tie_break_gap": 0.05},
            "objective proven optimal; its tie-break within 5.0%",
        ),
        ({"gap": 0.0, "tie_break_gap": None}, "its tie-break not proven (time limit)"),
    ],
)
def test_the_search_line_says_what_is_proven(search: dict, says: str) -> None:
    from nicoffload.cli.plan import search_line

    line = search_line({"method": "MILP", "seconds": 1.234, **search})
    assert line.startswith("search: MILP, 1.23 s: ") and says in line
