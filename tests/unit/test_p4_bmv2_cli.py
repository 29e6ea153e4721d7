"""A plan's WriteRequest becomes BMv2 runtime CLI commands, entry for entry."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("p4.v1", reason="P4Runtime entries need the 'p4' extra (p4runtime)")

from nicoffload.p4 import P4INFO
from nicoffload.p4._proto import proto
from nicoffload.p4.bmv2 import commands, render
from nicoffload.p4.entries import SteerEntry, write_request
from nicoffload.p4.p4info import P4Info, P4InfoMismatch
from nicoffload.p4.switch import read_pcap

STEER = "NicoffloadIngress.steer"


@pytest.fixture(scope="module")
def info() -> P4Info:
    return P4Info.load(P4INFO)


def _entries() -> tuple[SteerEntry, ...]:
    return (
        SteerEntry(0x91C543E6, 1, "s0-dpu0", "dpu0", 1, 0),
        SteerEntry(0x91C543E6, 2, "s1-cpu", "cpu", 511, 65535),
    )


def test_inserts_become_table_add_and_the_default_table_set_default(info) -> None:
    request = write_request(_entries(), 3, info)
    assert commands(request, info) == [
        f"table_add {STEER} NicoffloadIngress.forward 2445624294 1 => 1 0",
        f"table_add {STEER} NicoffloadIngress.forward 2445624294 2 => 511 65535",
        f"table_set_default {STEER} NicoffloadIngress.to_slow_path 3",
    ]
    assert render(request, info) == "".join(line + "\n" for line in commands(request, info))


def test_match_fields_and_params_follow_the_p4info_order_not_the_requests(info) -> None:
    request = write_request(_entries()[:1], 3, info)
    te = request.updates[0].entity.table_entry
    te.match.reverse()  # P4Runtime does not order repeated fields
    te.action.action.params.reverse()
    assert (
        commands(request, info)[0]
        == f"table_add {STEER} NicoffloadIngress.forward 2445624294 1 => 1 0"
    )


@pytest.mark.parametrize("kind", ["DELETE", "MODIFY"])
def test_updates_that_need_an_entry_handle_are_refused(info, kind: str) -> None:
    request = write_request(_entries(), 3, info)
    request.updates[0].type = proto().p4runtime_pb2.Update.Type.Value(kind)
    with pytest.raises(P4InfoMismatch, match=f"bmv2: a {kind} of a table entry"):
        commands(request, info)


def test_a_request_the_p4info_refuses_is_not_translated(info) -> None:
    request = write_request(_entries(), 3, info)
    request.updates[0].entity.table_entry.match[0].exact.value = b""
    with pytest.raises(P4InfoMismatch, match="an empty byte string"):
        commands(request, info)


def test_a_pcap_record_still_being_written_is_not_read() -> None:
    head = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)
    rec = struct.pack("<IIII", 0, 0, 3, 3) + b"abc"
    assert read_pcap(head + rec + rec) == [b"abc", b"abc"]
    assert read_pcap(head + rec + rec[:-1]) == [b"abc"]
    assert read_pcap(head + rec[:10]) == []
