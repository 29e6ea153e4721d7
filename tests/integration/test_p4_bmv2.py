"""The compiled program on BMv2, with the entries `nicoffload p4 entries --format bmv2` writes
for real plans: the frames the project's sender and its scapy layer build for each stage leave
by the port of the stage's device (forward() given its queue), each entry counts them, and
everything else (no entry, other UDP, a bad magic or version, a cut-short header, a frame.py
whose field moved) takes the slow path, counted by reason. One switch run (pcap files, no
privileges) serves every test here."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("p4.v1", reason="P4Runtime entries need the 'p4' extra (p4runtime)")
pytest.importorskip("scapy", reason="the frames are built with the 'p4' extra's scapy")

from scapy.layers.inet import IP, UDP, IPOption_NOP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw
from typer.testing import CliRunner

from nicoffload.cli import build_app
from nicoffload.p4 import P4_SOURCE, UDP_PORT
from nicoffload.p4.ids import pipeline_id, stage_ids
from nicoffload.p4.source import P4Source
from nicoffload.p4.switch import PcapSwitch
from nicoffload.p4.toolchain import (
    BUILD_DIR,
    REQUIRE_ENV,
    ToolsMissing,
    compile_program,
    find_tools,
)
from nicoffload.planner.plan import Plan
from nicoffload.transport import frame
from nicoffload.transport.frame import OUT_OF_BAND, Header, Kind
from nicoffload.transport.scapy_layer import Nicoffload
from nicoffload.transport.slots import Packer

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "pipelines" / "topologies" / "bluefield3-h100.yaml"
PIPELINES = ("clip", "resnet50")
INGRESS, SLOW_PATH = 0, 3
PORTS = {"dpu0": 1, "cpu": 2, "gpu0": 4}  # one port each, so that where a frame left says why
QUEUES = {"dpu0": 0, "cpu": 1, "gpu0": 2}
P4_SECTION = f"""
p4:
  slow_path: {SLOW_PATH}
  devices:
""" + "".join(f"    {d}: {{port: {PORTS[d]}, queue: {QUEUES[d]}}}\n" for d in PORTS)
_CONSTANTS = P4Source.read(P4_SOURCE).constants()  # the program's slow-path reasons
NOT_NICOFFLOAD, BAD_HEADER, NO_ENTRY = (
    _CONSTANTS[f"REASON_{name}"] for name in ("NOT_NICOFFLOAD", "BAD_HEADER", "NO_ENTRY")
)
SLOW = "NicoffloadIngress.slow_path_packets"
HITS = "NicoffloadIngress.steer_hits"


@dataclass(frozen=True)
class Sent:
    name: str
    frame: bytes
    port: int  # where it should leave
    entry: tuple[int, int] | None = None  # the (pipeline_id, stage_id) entry that steers it
    reason: int | None = None  # the slow path's reason, for a frame no entry steers
    queue: int = 0  # the receive queue forward() is given


@dataclass(frozen=True)
class Run:
    sent: list[Sent]
    left: dict[bytes, list[int]]  # a frame's bytes -> every port it left by
    handles: dict[tuple[int, int], int]  # entry -> BMv2's handle
    actions: dict[int, tuple[str, tuple[int, ...]]]  # frame number -> the steer table's action
    counters: dict[tuple[str, int], tuple[int, int]]  # (counter, index) -> (packets, bytes)


def _udp(payload: bytes, dport: int = UDP_PORT, **ip) -> bytes:
    return bytes(
        Ether()
        / IP(src="10.0.0.1", dst="10.0.0.2", **ip)
        / UDP(sport=40000, dport=dport)
        / Raw(payload)
    )


def _frame_py_with_a_moved_field() -> types.ModuleType:
    """frame.py as it would be if flags and stage_id traded places (and p4/ did not follow)."""
    moved = Path(frame.__file__).read_text()
    for before, after in [
        (
            '("flags", 16),\n    ("pipeline_id", 32),\n    ("stage_id", 16),',
            '("stage_id", 16),\n    ("pipeline_id", 32),\n    ("flags", 16),',
        ),
        (
            "self.flags,\n            self.pipeline_id,\n            self.stage_id,",
            "self.stage_id,\n            self.pipeline_id,\n            self.flags,",
        ),
    ]:  # the field list, and Header.pack's values in wire order
        assert moved.count(before) == 1, f"frame.py changed: {before!r} is not there once"
        moved = moved.replace(before, after)
    module = types.ModuleType("frame_moved")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(moved, "frame_moved.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def _stage_frames(plans: dict[str, Plan]) -> list[Sent]:
    """For each stage (and egress) of each plan: the DATA frame head the project's sender
    announces (frame.py, through the slot Packer) and the scapy layer's frame of the same ids."""
    out, request = [], 1
    tensors = {"pixels": np.zeros((2, 3, 8, 8), np.float16)}
    for name, plan in plans.items():
        pid, ids = pipeline_id(plan.pipeline), stage_ids(plan)
        devices = {s.name: s.device for s in plan.stages} | {"egress": plan.egress}
        for stage, sid in ids.items():
            port, queue = PORTS[devices[stage]], QUEUES[devices[stage]]
            _, layout = Packer(1 << 20, OUT_OF_BAND, pid, sid)(tensors)
            head = bytes(layout.announce(slot=1, request_id=request))
            out.append(Sent(f"{name}/{stage} sender", _udp(head), port, (pid, sid), queue=queue))
            scapy = Nicoffload(
                kind=int(Kind.DATA), pipeline_id=pid, stage_id=sid, request_id=request
            )
            out.append(
                Sent(f"{name}/{stage} scapy", _udp(bytes(scapy)), port, (pid, sid), queue=queue)
            )
            request += 1
    return out


def _slow_frames(plans: dict[str, Plan]) -> list[Sent]:
    plan = plans[PIPELINES[0]]
    pid, sid = pipeline_id(plan.pipeline), stage_ids(plan)[plan.stages[0].name]
    good = frame.encode(Header(Kind.DATA, pipeline_id=pid, stage_id=sid, request_id=900))
    bad_magic = b"XICO" + good[4:]
    bad_version = good[:4] + b"\x02" + good[5:]
    moved = _frame_py_with_a_moved_field()
    shifted = moved.encode(
        moved.Header(moved.Kind.DATA, pipeline_id=pid, stage_id=sid, request_id=901)
    )
    cases = [
        (
            "a stage with no entry",
            frame.encode(Header(Kind.DATA, pipeline_id=pid, stage_id=999)),
            NO_ENTRY,
        ),
        (
            "a pipeline with no entry",
            frame.encode(Header(Kind.DATA, pipeline_id=pipeline_id("other"), stage_id=1)),
            NO_ENTRY,
        ),
        ("unstamped 0/0", frame.encode(Header(Kind.DATA, request_id=902)), NO_ENTRY),
        ("frame.py with flags and stage_id swapped", shifted, NO_ENTRY),
        ("a bad magic", bad_magic, BAD_HEADER),
        ("a bad version", bad_version, BAD_HEADER),
        ("a header cut short", good[:40], BAD_HEADER),
    ]
    sent = [Sent(name, _udp(blob), SLOW_PATH, reason=reason) for name, blob, reason in cases]
    device = plan.stages[0].device
    today = Sent("today's frame.py, the same ids", _udp(good), PORTS[device], (pid, sid))
    sent.append(replace(today, queue=QUEUES[device]))
    sent += [
        Sent("UDP to another port", _udp(good, dport=53), SLOW_PATH, reason=NOT_NICOFFLOAD),
        Sent(
            "IPv4 with options",
            _udp(good, options=[IPOption_NOP()] * 4),
            SLOW_PATH,
            reason=NOT_NICOFFLOAD,
        ),
        Sent("a later IPv4 fragment", _udp(good, frag=8), SLOW_PATH, reason=NOT_NICOFFLOAD),
        Sent("ARP", bytes(Ether() / ARP()), SLOW_PATH, reason=NOT_NICOFFLOAD),
    ]
    return sent


def _cli(*args: object) -> str:
    result = CliRunner().invoke(build_app(), [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    try:
        tools = find_tools()
    except ToolsMissing as exc:
        if os.environ.get(REQUIRE_ENV):
            raise
        pytest.skip(str(exc))
    compiled = compile_program(P4_SOURCE, BUILD_DIR, tools)
    where = tmp_path_factory.mktemp("p4-bmv2")
    topology = where / "topology.yaml"
    topology.write_text(TOPOLOGY.read_text().split("\np4:")[0] + P4_SECTION)
    commands, plans = [], {}
    for name in PIPELINES:
        plan = where / f"{name}.json"
        _cli("plan", ROOT / "pipelines" / f"{name}.yaml", "--topology", topology, "-o", plan)
        plans[name] = Plan.load(plan)
        commands += _cli(
            "p4",
            "entries",
            plan,
            "--topology",
            topology,
            "--format",
            "bmv2",
            "--p4info",
            compiled.p4info,
        ).splitlines()
    sent = _stage_frames(plans) + _slow_frames(plans)
    assert len({s.frame for s in sent}) == len(sent), "every frame must be told apart by its bytes"
    with PcapSwitch(tools, compiled.json, [*PORTS.values(), SLOW_PATH], INGRESS) as switch:
        handles = switch.install(commands)
        switch.send(s.frame for s in sent)
        out = switch.received(len(sent))
        actions = switch.actions("NicoffloadIngress.steer")
        entries = [tuple(map(int, c.split()[3:5])) for c in commands if c.startswith("table_add")]
        by_entry = dict(zip(entries, handles, strict=True))
        reads = [(SLOW, r) for r in (NOT_NICOFFLOAD, BAD_HEADER, NO_ENTRY)]
        counters = switch.counters(reads + [(HITS, h) for h in handles])
    left: dict[bytes, list[int]] = {}
    for port, frames in out.items():
        for f in frames:
            left.setdefault(f, []).append(port)
    return Run(sent, left, by_entry, actions, counters)


def _stage(run: Run) -> list[Sent]:
    return [s for s in run.sent if s.entry is not None]


def test_the_plans_put_stages_on_more_than_one_device(run: Run) -> None:
    assert len({s.port for s in _stage(run)}) >= 2  # else port checks could not tell stages apart


def test_each_stage_frame_leaves_once_unchanged_by_the_port_of_its_device(run: Run) -> None:
    wrong = {
        s.name: (s.port, run.left.get(s.frame))
        for s in _stage(run)
        if run.left.get(s.frame) != [s.port]
    }
    assert wrong == {}


def test_each_stage_frame_is_forwarded_with_its_devices_port_and_queue(run: Run) -> None:
    # v1model has no receive queues: the queue is only an argument of forward(), seen in the log
    for i, s in enumerate(run.sent):
        want = (
            ("NicoffloadIngress.forward", (s.port, s.queue))
            if s.entry
            else ("NicoffloadIngress.to_slow_path", (SLOW_PATH,))
        )
        assert run.actions.get(i) == want, s.name


def test_each_entry_counts_the_frames_it_steered_packets_and_bytes(run: Run) -> None:
    for entry, handle in run.handles.items():
        mine = [s for s in _stage(run) if s.entry == entry]
        assert len(mine) >= 2, entry  # the sender's and scapy's at least
        want = (len(mine), sum(len(s.frame) for s in mine))
        assert run.counters[HITS, handle] == want, entry


@pytest.mark.parametrize(
    "name",
    [
        "a stage with no entry",
        "a pipeline with no entry",
        "unstamped 0/0",
        "frame.py with flags and stage_id swapped",
        "a bad magic",
        "a bad version",
        "a header cut short",
        "UDP to another port",
        "IPv4 with options",
        "a later IPv4 fragment",
        "ARP",
    ],
)
def test_unknown_or_malformed_traffic_leaves_by_the_slow_path(run: Run, name: str) -> None:
    (sent,) = [s for s in run.sent if s.name == name]
    assert run.left.get(sent.frame) == [SLOW_PATH]


def test_the_slow_path_counts_each_frame_under_its_reason(run: Run) -> None:
    for reason in (NOT_NICOFFLOAD, BAD_HEADER, NO_ENTRY):
        mine = [s for s in run.sent if s.reason == reason]
        assert run.counters[SLOW, reason] == (len(mine), sum(len(s.frame) for s in mine)), reason


def test_a_frame_py_whose_field_moved_is_not_steered_where_frame_py_today_is(run: Run) -> None:
    # The same header values, packed by today's frame.py, leave by the stage's port; with flags
    # and stage_id swapped in frame.py alone, BMv2 reads stage 0 (the flags) and finds no entry.
    (today,) = [s for s in run.sent if s.name == "today's frame.py, the same ids"]
    (moved,) = [s for s in run.sent if s.name == "frame.py with flags and stage_id swapped"]
    assert run.left[today.frame] == [today.port] != [SLOW_PATH]
    assert run.left[moved.frame] == [SLOW_PATH]
    assert run.counters[SLOW, NO_ENTRY][0] >= 1
