"""frame.py, the scapy layer and the P4 program describe the same header bytes; captures decode."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("scapy", reason="the scapy layer needs the 'p4' extra")

from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap
from test_frame import FAST, U, headers, wire

from nicoffload.p4 import P4_SOURCE, UDP_PORT
from nicoffload.p4.source import P4Source
from nicoffload.transport import frame
from nicoffload.transport.frame import HEADER_FIELDS, HEADER_SIZE, Header, Kind
from nicoffload.transport.scapy_layer import Nicoffload, read_capture


def _scapy_fields() -> list[tuple[str, int]]:
    return [(f.name, f.sz * 8) for f in Nicoffload.fields_desc]


def test_frame_py_scapy_and_the_p4_header_have_the_same_fields_widths_and_order() -> None:
    p4 = P4Source.read(P4_SOURCE).header("nicoffload_t")
    assert list(p4) == list(HEADER_FIELDS)
    assert _scapy_fields() == list(HEADER_FIELDS)
    assert len(Nicoffload()) == HEADER_SIZE == sum(bits for _, bits in p4) // 8


def test_the_p4_program_matches_frame_py_constants_and_the_udp_port() -> None:
    consts = P4Source.read(P4_SOURCE).constants()
    assert consts["NICOFFLOAD_MAGIC"] == frame.MAGIC_U32
    assert consts["NICOFFLOAD_VERSION"] == frame.VERSION
    assert consts["NICOFFLOAD_UDP_PORT"] == UDP_PORT


def test_the_header_reader_refuses_a_field_that_is_not_bit_n() -> None:
    with pytest.raises(ValueError, match="not bit<N>"):
        P4Source("header h_t { bit<8> a; varbit_t b; }").header("h_t")


def _scapy_of(header: Header, meta: bytes) -> Nicoffload:
    """The scapy packet of `header`, every field set from its own attributes (checksum left
    for scapy to compute)."""
    shape = (*header.shape, 0, 0, 0, 0)
    return Nicoffload(
        kind=int(header.kind),
        flags=header.flags,
        pipeline_id=header.pipeline_id,
        stage_id=header.stage_id,
        slot=header.slot,
        request_id=header.request_id,
        batch_size=header.batch_size,
        meta_len=len(meta),
        payload_len=header.payload_len,
        dtype=int(header.dtype),
        ndim=len(header.shape),
        shape0=shape[0],
        shape1=shape[1],
        shape2=shape[2],
        shape3=shape[3],
    ) / Raw(meta)


@settings(FAST, max_examples=200)
@given(headers(), st.binary(max_size=200))
def test_scapy_built_headers_parse_back_through_frame_py_identically(
    header: Header, meta: bytes
) -> None:
    raw = bytes(_scapy_of(header, meta))
    assert raw == wire(header, meta)
    got = Header.unpack(raw, max_payload=U["payload_len"])
    assert got == Header(**{**header.__dict__, "meta_len": len(meta)})


@settings(FAST, max_examples=200)
@given(headers(), st.binary(max_size=200))
def test_frame_py_packed_headers_parse_through_scapy_field_for_field(
    header: Header, meta: bytes
) -> None:
    raw = wire(header, meta)
    pkt = Nicoffload(raw)
    on_wire = frame._STRUCT.unpack_from(raw)
    assert [pkt.getfieldval(name) for name, _ in HEADER_FIELDS] == list(on_wire)
    assert bytes(pkt.payload) == meta
    assert bytes(pkt) == raw


def test_scapy_computes_the_checksum_frame_py_checks() -> None:
    raw = bytes(Nicoffload(kind=int(Kind.HELLO), meta_len=4) / Raw(b"meta"))
    assert raw[60:64] == zlib.crc32(raw[:60] + b"meta").to_bytes(4, "big")


def test_udp_to_the_nicoffload_port_dissects_as_nicoffload() -> None:
    pkt = Ether(bytes(Ether() / IP() / UDP(sport=40000, dport=UDP_PORT) / Nicoffload(slot=3)))
    assert pkt[Nicoffload].slot == 3


def _capture(tmp_path: Path) -> Path:
    good = wire(Header(Kind.DATA, pipeline_id=7, stage_id=2, slot=1, request_id=9), b"xy")
    bad = bytearray(good)
    bad[-3] ^= 0xFF  # a flipped checksum byte
    udp = Ether() / IP(src="10.0.0.1", dst="10.0.0.2")
    path = tmp_path / "cap.pcap"
    wrpcap(
        str(path),
        [
            udp / UDP(sport=40000, dport=UDP_PORT) / Raw(good),
            udp / UDP(sport=40000, dport=53) / Raw(b"dns"),  # not nicoffload: skipped
            udp / UDP(sport=40000, dport=UDP_PORT) / Raw(bytes(bad)),
            udp / UDP(sport=40000, dport=UDP_PORT) / Raw(b"short"),
        ],
    )
    return path


def test_a_capture_yields_its_nicoffload_frames_with_frame_py_verdicts(tmp_path: Path) -> None:
    got = list(read_capture(_capture(tmp_path)))
    assert [f.index for f in got] == [0, 2, 3]
    ok, bad, short = got
    assert ok.error is None and ok.src == "10.0.0.1:40000" and ok.dst == "10.0.0.2:7700"
    assert (ok.fields["pipeline_id"], ok.fields["stage_id"], ok.fields["request_id"]) == (7, 2, 9)
    assert ok.transport == "udp" and ok.length == HEADER_SIZE + 2
    assert bad.error is not None and "checksum" in bad.error
    assert short.error is not None and short.fields == {}


def _tcp(tmp_path: Path, stream: bytes, cuts: list[int], *, drop: int | None = None) -> Path:
    """One TCP direction carrying `stream`, cut into segments at `cuts` (SYN first, the second
    segment sent twice, segment `drop` lost), and an HTTP flow that is no nicoffload stream."""
    ip = Ether() / IP(src="10.0.0.1", dst="10.0.0.2")
    isn = 1000
    pkts = [ip / TCP(sport=5000, dport=7700, flags="S", seq=isn)]
    bounds = [0, *cuts, len(stream)]
    segs = [
        ip / TCP(sport=5000, dport=7700, flags="A", seq=isn + 1 + a) / Raw(stream[a:b])
        for a, b in itertools.pairwise(bounds)
    ]
    segs.insert(2, segs[1])  # a retransmission
    if drop is not None:
        del segs[drop]
    pkts += [*segs, ip / TCP(sport=5001, dport=80, seq=1) / Raw(b"GET / HTTP/1.1\r\n")]
    path = tmp_path / "tcp.pcap"
    wrpcap(str(path), pkts)
    return path


def _frames() -> tuple[bytes, bytes]:
    data = Header(Kind.DATA, slot=1, request_id=5, batch_size=1, payload_len=10)
    return wire(Header(Kind.HELLO), b"meta"), wire(data) + bytes(range(10))


def test_a_tcp_stream_is_reassembled_into_its_frames_payloads_skipped(tmp_path: Path) -> None:
    hello, data = _frames()
    stream = hello + data
    got = read_capture(_tcp(tmp_path, stream, [10, len(hello) + 30]))
    assert [(f.transport, f.error) for f in got] == [("tcp", None), ("tcp", None)]
    assert [Kind(f.fields["kind"]) for f in got] == [Kind.HELLO, Kind.DATA]
    assert [f.length for f in got] == [len(hello), len(data)]
    assert [f.index for f in got] == [1, 2]  # the packets holding each frame's first byte
    assert got[0].src == "10.0.0.1:5000" and got[0].dst == "10.0.0.2:7700"


def test_a_tcp_stream_with_lost_bytes_stops_at_the_gap(tmp_path: Path) -> None:
    hello, data = _frames()
    # the DATA header arrives whole, then 2 of its 10 payload bytes, then a segment is lost
    cuts = [10, len(hello) + HEADER_SIZE + 2, len(hello) + HEADER_SIZE + 6]
    got = read_capture(_tcp(tmp_path, hello + data, cuts, drop=3))
    assert len(got) == 2 and got[0].error is None
    assert got[1].fields["kind"] == Kind.DATA and "misses stream bytes" in got[1].error
