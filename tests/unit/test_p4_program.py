"""p4/nicoffload.p4info.txtpb is the P4Info of p4/nicoffload.p4: read from the program itself."""

from __future__ import annotations

import pytest

pytest.importorskip("p4.v1", reason="the P4Info check needs the 'p4' extra (p4runtime)")

from nicoffload.p4 import P4_SOURCE, P4INFO
from nicoffload.p4._proto import proto
from nicoffload.p4.p4info import P4Info
from nicoffload.p4.ports import PORT_BITS, QUEUE_BITS
from nicoffload.p4.source import P4Source

PREFIX = {"table": 0x02, "action": 0x01, "counter": 0x12, "direct_counter": 0x13}
UNIT = {"packets_and_bytes": "BOTH", "packets": "PACKETS", "bytes": "BYTES"}


@pytest.fixture(scope="module")
def info() -> P4Info:
    return P4Info.load(P4INFO)


@pytest.fixture(scope="module")
def src() -> P4Source:
    return P4Source.read(P4_SOURCE)


def _id(kind: str, local: int) -> int:
    return PREFIX[kind] << 24 | local


def test_every_action_of_the_program_is_in_the_p4info_with_its_id_and_params(info, src) -> None:
    want = {(_id("action", a.id), a.name, a.params) for a in src.actions()}
    got = {
        (a.preamble.id, a.preamble.name, tuple((p.name, p.bitwidth) for p in a.params))
        for a in info.message.actions
    }
    assert got == want
    for a in info.message.actions:
        assert [p.id for p in a.params] == list(range(1, len(a.params) + 1))


def test_every_table_of_the_program_is_in_the_p4info_with_keys_actions_and_size(info, src) -> None:
    pb = proto().p4info_pb2
    actions = {_id("action", a.id): a.name for a in src.actions()}
    counters = {c.name: _id("direct_counter", c.id) for c in src.counters() if c.direct}
    scope = {"": "TABLE_AND_DEFAULT", "tableonly": "TABLE_ONLY", "defaultonly": "DEFAULT_ONLY"}
    tables = src.tables()
    assert len(tables) == len(info.message.tables)
    for t in tables:
        pt = info.tables[_id("table", t.id)]
        assert pt.preamble.name == t.name and pt.size == t.size
        keys = [
            (f.name, pb.MatchField.MatchType.Name(f.match_type).lower(), f.bitwidth)
            for f in pt.match_fields
        ]
        assert keys == list(t.keys)
        refs = [(actions[r.id], pb.ActionRef.Scope.Name(r.scope)) for r in pt.action_refs]
        assert refs == [(name, scope[note]) for name, note in t.actions]
        assert list(pt.direct_resource_ids) == ([counters[t.counters]] if t.counters else [])


def test_every_counter_of_the_program_is_in_the_p4info(info, src) -> None:
    pb = proto().p4info_pb2
    want = {
        (_id("direct_counter" if c.direct else "counter", c.id), c.name, UNIT[c.unit], c.size)
        for c in src.counters()
    }
    got = {
        (c.preamble.id, c.preamble.name, pb.CounterSpec.Unit.Name(c.spec.unit), c.size)
        for c in info.message.counters
    } | {
        (c.preamble.id, c.preamble.name, pb.CounterSpec.Unit.Name(c.spec.unit), None)
        for c in info.message.direct_counters
    }
    assert got == want
    for c in info.message.direct_counters:
        assert c.direct_table_id in info.tables


def test_the_steering_default_is_the_slow_path_and_the_reasons_fit_its_counter(src) -> None:
    assert "default_action = to_slow_path(" in src.text
    reasons = [v for k, v in src.constants().items() if k.startswith("REASON_")]
    (slow,) = [c for c in src.counters() if c.name.endswith("slow_path_packets")]
    assert sorted(reasons) == list(range(slow.size))


def test_the_port_map_widths_are_the_programs(info) -> None:
    forward = info.action("forward")
    assert info.param(forward, "port").bitwidth == PORT_BITS
    assert info.param(forward, "queue").bitwidth == QUEUE_BITS
    assert info.param(info.action("to_slow_path"), "port").bitwidth == PORT_BITS
