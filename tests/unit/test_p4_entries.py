"""A plan becomes steering entries that the P4Info accepts; a stage with no port is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

pytest.importorskip("p4.v1", reason="P4Runtime entries need the 'p4' extra (p4runtime)")

from nicoffload.errors import TopologyError
from nicoffload.graph import load_pipeline
from nicoffload.p4 import P4INFO
from nicoffload.p4._proto import proto
from nicoffload.p4.entries import check_devices, render, steering, write_request
from nicoffload.p4.ids import EGRESS_STAGE_ID, pipeline_id, stage_ids
from nicoffload.p4.p4info import P4Info, P4InfoMismatch, decode, encode
from nicoffload.p4.ports import load_ports
from nicoffload.planner import plan_for
from nicoffload.planner.plan import Plan, single_device_plan, stages_for
from nicoffload.topology import load_topology, local_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = ROOT / "pipelines" / "topologies"
WITH_PORTS = ("bluefield3-h100", "bluefield2-a100", "edge-25g")
PIPELINES = ("resnet50", "bert", "clip")


@pytest.fixture(scope="module")
def info() -> P4Info:
    return P4Info.load(P4INFO)


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, str], Plan]:
    return {
        (p, t): plan_for(load_pipeline(ROOT / "pipelines" / f"{p}.yaml"), TOPOLOGIES / f"{t}.yaml")
        for p in PIPELINES
        for t in WITH_PORTS
    }


def _topo(tmp_path: Path, p4: str, name: str = "bluefield3-h100") -> Path:
    text = (TOPOLOGIES / f"{name}.yaml").read_text().split("\np4:")[0]
    path = tmp_path / "topo.yaml"
    path.write_text(text + "\n" + p4)
    return path


@pytest.mark.parametrize("topology", WITH_PORTS)
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_entries_for_the_example_plans_validate_against_the_p4info(
    plans, info, pipeline: str, topology: str
) -> None:
    plan = plans[pipeline, topology]
    topo = load_topology(TOPOLOGIES / f"{topology}.yaml")
    ports = load_ports(topo)
    steer = steering(plan, ports)
    request = write_request(steer, ports.slow_path, info)  # checks it against the P4Info
    assert len(steer) == len(plan.stages) + 1  # every stage, and the egress
    assert len({(e.pipeline_id, e.stage_id) for e in steer}) == len(steer)
    for e, stage in zip(steer, plan.stages, strict=False):
        assert (e.device, e.port) == (stage.device, ports.devices[stage.device].port)
    assert steer[-1].stage_id == EGRESS_STAGE_ID and steer[-1].device == plan.egress
    *inserts, default = request.updates
    assert all(u.type == proto().p4runtime_pb2.Update.INSERT for u in inserts)
    assert default.entity.table_entry.is_default_action


def test_a_pipeline_id_is_the_crc32_of_its_name_and_stages_count_from_one(plans) -> None:
    plan = plans["clip", "bluefield2-a100"]
    assert pipeline_id(plan.pipeline) == zlib.crc32(plan.pipeline.encode())
    assert list(stage_ids(plan).values()) == [*range(1, len(plan.stages) + 1), EGRESS_STAGE_ID]


def test_a_stage_whose_device_has_no_port_names_the_stage_device_and_line(tmp_path) -> None:
    path = _topo(tmp_path, "p4:\n  slow_path: 2\n  devices:\n    dpu0: {port: 1}\n")
    pipeline = load_pipeline(ROOT / "pipelines" / "resnet50.yaml")
    placement = {n.name: "dpu0" if n.name == "decode" else "cpu" for n in pipeline.nodes}
    plan = Plan(pipeline.name, placement, *stages_for(pipeline, placement), egress="gpu0")
    with pytest.raises(TopologyError) as exc:
        steering(plan, load_ports(load_topology(path)))
    # at the devices mapping, where the missing device belongs
    assert exc.value.mark.line == path.read_text().splitlines().index("    dpu0: {port: 1}") + 1
    msg = str(exc.value)
    assert "stage 's1-cpu' runs on device 'cpu'" in msg and "ports exist for: dpu0" in msg
    assert msg.startswith(f"{tmp_path / 'topo.yaml'}:")
    assert exc.value.exit_code == 2


def test_a_topology_without_a_p4_section_says_to_add_one() -> None:
    with pytest.raises(TopologyError, match="has no 'p4' section"):
        load_ports(load_topology(TOPOLOGIES / "host-only.yaml"))
    with pytest.raises(TopologyError, match="pass --topology"):
        load_ports(local_topology(gpu=False))


@pytest.mark.parametrize(
    ("p4", "line", "message"),
    [
        ("p4:\n  slow_path: 2\n  devices:\n    dpu1: {port: 1}\n", 4, "unknown device 'dpu1'"),
        ("p4:\n  slow_path: 2\n  devices:\n    dpu0: {port: 512}\n", 4, r"0 to 511 \(9 bits\)"),
        ("p4:\n  slow_path: 2\n  devices:\n    cpu: {port: 1, q: 1}\n", 4, "unknown key 'q'"),
        ("p4:\n  slowpath: 2\n  devices: {}\n", 2, "unknown key 'slowpath'"),
        ("p4:\n  devices: {}\n", 2, "missing 'slow_path'"),
    ],
)
def test_p4_section_mistakes_point_at_their_line(
    tmp_path, p4: str, line: int, message: str
) -> None:
    path = _topo(tmp_path, p4)
    first = len(path.read_text().split("\np4:")[0].splitlines())  # the line before 'p4:'
    with pytest.raises(TopologyError, match=message) as exc:
        load_ports(load_topology(path))
    assert exc.value.mark.line == first + line


def test_a_plan_from_another_topology_names_the_missing_device() -> None:
    plan = single_device_plan(load_pipeline(ROOT / "pipelines" / "resnet50.yaml"), "dpu7")
    topo = load_topology(TOPOLOGIES / "bluefield3-h100.yaml")
    with pytest.raises(TopologyError, match="places work on 'dpu7'"):
        check_devices(plan, topo.ids, "topology 'bluefield3-h100'")


def test_the_json_form_parses_back_to_the_same_write_request(plans, info) -> None:
    pb = proto()
    ports = load_ports(load_topology(TOPOLOGIES / "bluefield3-h100.yaml"))
    request = write_request(steering(plans["clip", "bluefield3-h100"], ports), 2, info)
    back = pb.json_format.Parse(render(request, "json"), pb.p4runtime_pb2.WriteRequest())
    assert back == request
    text = pb.text_format.Parse(render(request, "text"), pb.p4runtime_pb2.WriteRequest())
    assert text == request


def test_values_are_canonical_byte_strings() -> None:
    assert encode(0, 16) == b"\x00" and encode(1, 9) == b"\x01" and encode(511, 9) == b"\x01\xff"
    with pytest.raises(ValueError, match="does not fit"):
        encode(512, 9)


def _mutate(request, how: str) -> None:
    te = request.updates[0].entity.table_entry
    match how:
        case "table id":
            te.table_id += 1
        case "not canonical":
            te.match[1].exact.value = b"\x00\x01"
        case "empty":
            te.match[0].exact.value = b""
        case "too wide":
            te.action.action.params[0].value = b"\x02\x00"
        case "field missing":
            del te.match[1]
        case "default-only action":
            te.action.action.action_id = request.updates[
                -1
            ].entity.table_entry.action.action.action_id
            del te.action.action.params[1]
        case "table-only default":
            request.updates[-1].entity.table_entry.CopyFrom(te)
            request.updates[-1].entity.table_entry.is_default_action = True
            del request.updates[-1].entity.table_entry.match[:]
        case "param missing":
            del te.action.action.params[1]
        case "priority":
            te.priority = 1


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("table id", "unknown table id"),
        ("empty", "an empty byte string"),
        ("too wide", "does not fit in 9 bits"),
        ("field missing", "exact fields \\['stage_id'\\] missing"),
        ("default-only action", "cannot be a table entry action"),
        ("table-only default", "cannot be a default action"),
        ("param missing", "takes params"),
        ("priority", "takes no priority"),
    ],
)
def test_the_p4info_check_refuses_what_a_target_would(plans, info, how: str, message: str) -> None:
    ports = load_ports(load_topology(TOPOLOGIES / "bluefield3-h100.yaml"))
    request = write_request(steering(plans["resnet50", "bluefield3-h100"], ports), 2, info)
    _mutate(request, how)
    with pytest.raises(P4InfoMismatch, match=message):
        info.check(request)


def test_the_check_holds_the_request_to_the_canonical_form_an_encoder_must_write(
    plans, info
) -> None:
    # A server accepts b"\x00\x01" for stage 1 (the spec's receiver rule), but read-write
    # symmetry asks the encoder for the shortest string, and the entries are ours to encode.
    ports = load_ports(load_topology(TOPOLOGIES / "bluefield3-h100.yaml"))
    request = write_request(steering(plans["resnet50", "bluefield3-h100"], ports), 2, info)
    _mutate(request, "not canonical")
    with pytest.raises(P4InfoMismatch, match="not a canonical byte string"):
        info.check(request)


def test_a_received_byte_string_may_be_padded_but_not_empty_or_too_wide() -> None:
    assert decode(b"\x00\x00", 9, "port") == 0  # what p4c writes for a 0 of bit<9>
    assert decode(b"\x00\x00\x01\xff", 9, "port") == 511
    with pytest.raises(P4InfoMismatch, match="port: an empty byte string"):
        decode(b"", 9, "port")
    with pytest.raises(P4InfoMismatch, match="port: 512 does not fit in 9 bits"):
        decode(b"\x00\x02\x00", 9, "port")


def _padded_default(info: P4Info, value: bytes) -> P4Info:
    message = type(info.message)()
    message.CopyFrom(info.message)
    message.tables[0].initial_default_action.arguments[0].value = value
    return P4Info(message, "p4c.txtpb")


def test_canonical_rewrites_p4cs_padded_initial_default_argument(info) -> None:
    padded = _padded_default(info, b"\x00\x00")
    assert padded.message != info.message
    assert padded.canonical() == info.message
    assert info.canonical() == info.message


def test_an_initial_default_argument_too_wide_for_its_param_is_refused(info) -> None:
    with pytest.raises(P4InfoMismatch, match=r"p4c\.txtpb: 'NicoffloadIngress\.steer' initial"):
        _padded_default(info, b"\x02\x00").canonical()


def test_protobuf_loaded_first_in_its_fast_mode_is_a_failure_that_says_what_to_set() -> None:
    code = (
        "import google.protobuf.message\n"
        "from nicoffload.errors import SystemFailure\n"
        "from nicoffload.p4._proto import proto\n"
        "try:\n    proto()\nexcept SystemFailure as exc:\n    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "set PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python" in out.stdout, out.stderr
