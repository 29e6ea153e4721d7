"""`nicoffload p4 entries` and `nicoffload pcap`: output forms, files, and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("p4.v1", reason="the p4 commands need the 'p4' extra")
pytest.importorskip("scapy", reason="the p4 commands need the 'p4' extra")

import nicoffload.cli.p4  # noqa: F401  (registers the commands until build_app lists them)
from nicoffload.cli import build_app
from nicoffload.graph import load_pipeline
from nicoffload.p4._proto import proto
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.transport.frame import Header, Kind

ROOT = Path(__file__).resolve().parents[2]
BF3 = str(ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml")


@pytest.fixture
def plan_file(tmp_path: Path) -> str:
    """A DPU-then-host plan of resnet50, made by hand so no kernel registry shapes it."""
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    placement = {n.name: "dpu0" if n.name == "decode" else "cpu" for n in pipeline.nodes}
    plan = Plan(
        pipeline.name,
        placement,
        *stages_for(pipeline, placement),
        topology="bluefield3-h100",
        egress="gpu0",
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


def _run(*args: str):
    return CliRunner().invoke(build_app(), list(args))


def test_entries_prints_a_text_write_request_and_a_summary_on_stderr(plan_file) -> None:
    result = _run("p4", "entries", plan_file, "--topology", BF3)
    assert result.exit_code == 0, result.output
    pb = proto()
    request = pb.text_format.Parse(result.stdout, pb.p4runtime_pb2.WriteRequest())
    assert len(request.updates) == 4  # s0-dpu0, s1-cpu, egress, and the default entry
    assert "s1-cpu       -> cpu: port 2, queue 1" in result.stderr


def test_entries_json_is_one_document_on_stdout_and_output_writes_a_file(plan_file, tmp_path):
    result = _run("p4", "entries", plan_file, "--topology", BF3, "--format", "json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["updates"]) == 4
    out = tmp_path / "entries.txtpb"
    result = _run("p4", "entries", plan_file, "--topology", BF3, "-o", str(out))
    assert result.exit_code == 0 and result.stdout == ""
    assert "table_entry" in out.read_text()


def test_entries_bmv2_prints_the_cli_commands_that_install_them(plan_file) -> None:
    result = _run("p4", "entries", plan_file, "--topology", BF3, "--format", "bmv2")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["table_add"] * 3 + ["table_set_default"]
    # s1-cpu: stage 2 -> cpu, port 2, queue 1 (bluefield3-h100's p4 section)
    assert lines[1].startswith("table_add NicoffloadIngress.steer NicoffloadIngress.forward ")
    assert lines[1].endswith(" 2 => 2 1")
    assert lines[-1] == "table_set_default NicoffloadIngress.steer NicoffloadIngress.to_slow_path 2"
    assert "s1-cpu       -> cpu: port 2, queue 1" in result.stderr


def test_entries_for_a_stage_without_a_port_exits_2_with_the_place(plan_file, tmp_path) -> None:
    text = Path(BF3).read_text().replace("    cpu: {port: 2, queue: 1}", "")
    topo = tmp_path / "topo.yaml"
    topo.write_text(text)
    result = _run("p4", "entries", plan_file, "--topology", str(topo))
    assert result.exit_code == 2
    assert f"{topo}:" in result.stderr and "stage 's1-cpu' runs on device 'cpu'" in result.stderr
    assert "Traceback" not in result.output


def test_entries_with_a_bad_format_plan_or_no_topology_exits_2(plan_file, tmp_path) -> None:
    assert _run("p4", "entries", plan_file, "--topology", BF3, "--format", "yaml").exit_code == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert _run("p4", "entries", str(bad), "--topology", BF3).exit_code == 2
    result = _run("p4", "entries", plan_file)
    assert result.exit_code == 2 and "pass --topology" in result.stderr


def test_pcap_lists_each_frame_and_its_verdict(tmp_path: Path) -> None:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw
    from scapy.utils import wrpcap

    raw = Header(Kind.REQUEST, pipeline_id=5, stage_id=1, request_id=42).pack()
    path = tmp_path / "c.pcap"
    wrpcap(str(path), [Ether() / IP() / UDP(sport=1, dport=7700) / Raw(raw)])
    result = _run("pcap", str(path))
    assert result.exit_code == 0, result.output
    assert "REQUEST pipeline=5 stage=1" in result.stdout and result.stdout.rstrip().endswith("ok")
    doc = json.loads(_run("pcap", str(path), "--json").stdout)
    assert doc["malformed"] == 0 and doc["frames"][0]["fields"]["request_id"] == 42


def test_pcap_of_a_file_that_is_no_capture_exits_2(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pcap"
    junk.write_bytes(b"not a capture at all")
    result = _run("pcap", str(junk))
    assert result.exit_code == 2 and "not a capture" in result.stderr
    assert _run("pcap", str(tmp_path / "missing.pcap")).exit_code == 2
