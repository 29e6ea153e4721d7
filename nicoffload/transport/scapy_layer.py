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
    MAGIC_U32,
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
    """One nicoffload header found in a capture, with frame.py's verdict on it."""

    index: int  # the packet's position in the capture, from 0
    time: float
    src: str  # "ip:port"
    dst: str
    fields: dict[str, int]  # every HEADER_FIELDS field as on the wire
    datagram_len: int  # bytes after the UDP header: header, meta, any payload
    error: str | None  # None when Header.unpack accepts it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_capture(path: str | Path, port: int = UDP_PORT) -> Iterator[CapturedFrame]:
    """The nicoffload frames of a pcap or pcapng file: UDP datagrams to or from `port`.

    Raises OSError for an unreadable file and scapy's Scapy_Exception for one that is no capture.
    """
    from scapy.layers.inet import IP
    from scapy.utils import PcapReader

    with PcapReader(str(path)) as reader:
        for index, pkt in enumerate(reader):
            if UDP not in pkt or port not in (pkt[UDP].dport, pkt[UDP].sport):
                continue
            raw = bytes(pkt[UDP].payload)
            if len(raw) < HEADER_SIZE:
                error = f"{len(raw)} bytes after UDP, fewer than the {HEADER_SIZE}-byte header"
                fields = {}
            else:
                head = Nicoffload(raw[:HEADER_SIZE])
                fields = {name: int(head.getfieldval(name)) for name, _ in HEADER_FIELDS}
                try:
                    Header.unpack(raw)
                    error = None
                except FrameError as exc:
                    error = str(exc)
            ip = pkt.getlayer(IP)
            src = f"{ip.src if ip else '?'}:{pkt[UDP].sport}"
            dst = f"{ip.dst if ip else '?'}:{pkt[UDP].dport}"
            yield CapturedFrame(index, float(pkt.time), src, dst, fields, len(raw), error)
