"""A scapy layer for the nicoffload frame header, built from `frame.HEADER_FIELDS`.

For tests and for reading captures (`nicoffload pcap`): `Nicoffload` is bound to UDP port
`nicoffload.p4.UDP_PORT`, the encapsulation the NIC program parses. Left as None, `checksum` is
computed on build like `Header.pack` does: CRC-32 over the header before it and the meta blob.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nicoffload.errors import FrameError, MissingDependency
from nicoffload.p4 import UDP_PORT
from nicoffload.transport.frame import (
    CHECKED_SIZE,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAGIC,
    MAGIC_U32,
    OUT_OF_BAND,
    VERSION,
    DType,
    Header,
    Kind,
)

try:
    from scapy.fields import (
        ByteEnumField,
        ByteField,
        Field,
        IntField,
        LongField,
        ShortField,
        XIntField,
        XShortField,
    )
    from scapy.layers.inet import UDP
    from scapy.packet import Packet, bind_layers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependency("scapy", "p4", "the nicoffload scapy layer") from exc

_PLAIN = {8: ByteField, 16: ShortField, 32: IntField, 64: LongField}
# Fields shown better than as a plain number; every width still comes from HEADER_FIELDS.
_SPECIAL = {
    "magic": lambda name, bits: XIntField(name, MAGIC_U32),
    "version": lambda name, bits: ByteField(name, VERSION),
    "kind": lambda name, bits: ByteEnumField(name, int(Kind.DATA), {k.value: k.name for k in Kind}),
    "flags": lambda name, bits: XShortField(name, 0),
    "dtype": lambda name, bits: ByteEnumField(name, 0, {d.value: d.name for d in DType}),
    "checksum": lambda name, bits: XIntField(name, None),
}


def _field(name: str, bits: int) -> Field:
    make = _SPECIAL.get(name)
    field = make(name, bits) if make else _PLAIN[bits](name, 0)
    assert field.sz * 8 == bits, (name, bits)
    return field


class Nicoffload(Packet):
    """The 64-byte nicoffload header; what follows (meta blob, payload) is its payload."""

    name = "nicoffload"
    fields_desc = [_field(name, bits) for name, bits in HEADER_FIELDS]  # noqa: RUF012 (scapy's API)

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.checksum is None:
            meta = pay[: self.meta_len]
            crc = zlib.crc32(meta, zlib.crc32(pkt[:CHECKED_SIZE]))
            pkt = pkt[:CHECKED_SIZE] + crc.to_bytes(4, "big") + pkt[HEADER_SIZE:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf(
            "nicoffload %kind% pipeline=%pipeline_id% stage=%stage_id% slot=%slot% "
            "req=%request_id% batch=%batch_size%"
        )


bind_layers(UDP, Nicoffload, dport=UDP_PORT)
bind_layers(UDP, Nicoffload, sport=UDP_PORT)


@dataclass(frozen=True)
class CapturedFrame:
    """One nicoffload frame found in a capture, with frame.py's verdict on it."""

    index: int  # the position in the capture of the packet holding its first byte, from 0
    time: float
    transport: str  # udp | tcp
    src: str  # "ip:port"
    dst: str
    fields: dict[str, int]  # every HEADER_FIELDS field as on the wire; {} if none could be read
    length: int  # udp: the bytes after the UDP header; tcp: the frame's bytes in the stream
    error: str | None  # None when Header.unpack accepts it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fields(raw: bytes | memoryview) -> dict[str, int]:
    head = Nicoffload(bytes(raw[:HEADER_SIZE]))
    return {name: int(head.getfieldval(name)) for name, _ in HEADER_FIELDS}


def _verdict(raw: bytes | memoryview) -> str | None:
    try:
        Header.unpack(raw)
    except FrameError as exc:
        return str(exc)
    return None


def read_capture(path: str | Path, port: int = UDP_PORT) -> list[CapturedFrame]:
    """The nicoffload frames of a pcap or pcapng file, in capture order: UDP datagrams to or
    from `port` (the NIC path), and TCP streams that begin with a frame (what the tcp:// transport
    and the DPU agent send today), reassembled from their segments.

    Raises OSError for an unreadable file and scapy's Scapy_Exception for one that is no capture.
    """
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6
    from scapy.packet import Padding
    from scapy.utils import PcapReader

    found: list[CapturedFrame] = []
    flows: dict[tuple[str, str], list[tuple[int, bytes, int, float]]] = {}
    with PcapReader(str(path)) as reader:
        for index, pkt in enumerate(reader):
            ip = pkt.getlayer(IP) or pkt.getlayer(IPv6)
            host = (ip.src, ip.dst) if ip else ("?", "?")
            if UDP in pkt and port in (pkt[UDP].dport, pkt[UDP].sport):
                udp, raw = pkt[UDP], bytes(pkt[UDP].payload)
                short = f"{len(raw)} bytes after UDP, fewer than the {HEADER_SIZE}-byte header"
                found.append(
                    CapturedFrame(
                        index,
                        float(pkt.time),
                        "udp",
                        f"{host[0]}:{udp.sport}",
                        f"{host[1]}:{udp.dport}",
                        _fields(raw) if len(raw) >= HEADER_SIZE else {},
                        len(raw),
                        _verdict(raw) if len(raw) >= HEADER_SIZE else short,
                    )
                )
            elif TCP in pkt:
                tcp, pad = pkt[TCP], pkt.getlayer(Padding)
                data = bytes(tcp.payload)
                if pad is not None:  # Ethernet's minimum-size padding is no stream data
                    data = data[: len(data) - len(pad.load)]
                seq = tcp.seq + (1 if tcp.flags.S else 0)  # a SYN takes one sequence number
                key = (f"{host[0]}:{tcp.sport}", f"{host[1]}:{tcp.dport}")
                flows.setdefault(key, []).append((seq, data, index, float(pkt.time)))
    for (src, dst), segments in flows.items():
        found.extend(_stream_frames(src, dst, segments))
    return sorted(found, key=lambda f: (f.index, f.src))


def _stream_frames(
    src: str, dst: str, segments: list[tuple[int, bytes, int, float]]
) -> Iterator[CapturedFrame]:
    """Reassemble one direction of a TCP connection and walk its frames, header to header.

    A frame's length is its head (header + meta) plus its payload, unless the payload went out of
    band. A malformed frame, a gap the capture missed or its end stop the walk: a byte stream
    cannot be resynchronised.
    """
    base = segments[0][0]
    buf, starts, gap = bytearray(), [], None
    for rel, data, index, time in sorted(((s - base) % (1 << 32), *rest) for s, *rest in segments):
        if not data or rel + len(data) <= len(buf):
            continue  # a bare ACK, or a retransmission of what we have
        if rel > len(buf):
            gap = f"the capture misses stream bytes {len(buf)} to {rel}"
            break
        starts.append((len(buf), index, time))
        buf += data[len(buf) - rel :]
    if not buf.startswith(MAGIC):
        return  # not a nicoffload stream (or its start was not captured)
    view, off = memoryview(buf), 0
    while off < len(buf):
        index, time = next((i, t) for o, i, t in reversed(starts) if o <= off)
        left = view[off:]
        if len(left) < HEADER_SIZE:
            end = gap or f"the capture ends inside a header ({len(left)} of {HEADER_SIZE} bytes)"
            yield CapturedFrame(index, time, "tcp", src, dst, {}, len(left), end)
            return
        fields, error = _fields(left), _verdict(left)
        size = HEADER_SIZE + fields["meta_len"]
        if not fields["flags"] & OUT_OF_BAND:
            size += fields["payload_len"]
        if error is None and size > len(left):
            error = gap or f"the capture ends inside the frame ({len(left)} of {size} bytes)"
        yield CapturedFrame(index, time, "tcp", src, dst, fields, min(size, len(left)), error)
        if error is not None:
            return
        off += size
    if gap:  # the walk ended on a frame boundary just before the missing bytes
        index, time = starts[-1][1:]
        yield CapturedFrame(index, time, "tcp", src, dst, {}, 0, gap)
