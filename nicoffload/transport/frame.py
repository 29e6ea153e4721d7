"""The nicoffload wire format: a fixed 64-byte header, a msgpack metadata blob, then the payload.

`HEADER_FIELDS` is the one source of truth: the struct format is derived from it, and the P4
header and the scapy layer must match it byte for byte. Nothing from the wire is unpickled.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, replace
from enum import IntEnum, IntFlag
from itertools import accumulate
from typing import Any

import msgspec
import numpy as np

from nicoffload.errors import FrameError, TransportError

# (field name, bit width), in wire order, network byte order (big-endian). 512 bits in all.
HEADER_FIELDS: tuple[tuple[str, int], ...] = (
    ("magic", 32),
    ("version", 8),
    ("kind", 8),
    ("flags", 16),
    ("pipeline_id", 32),
    ("stage_id", 16),
    ("slot", 16),
    ("request_id", 64),
    ("batch_size", 32),
    ("meta_len", 32),
    ("payload_len", 64),
    ("dtype", 8),
    ("ndim", 8),
    ("reserved", 16),
    ("shape0", 32),
    ("shape1", 32),
    ("shape2", 32),
    ("shape3", 32),
    ("checksum", 32),
)
# Byte offset of each field, for the P4 and scapy checks and for readers that peek at one field.
FIELD_OFFSETS: dict[str, int] = {
    name: end - bits // 8
    for (name, bits), end in zip(
        HEADER_FIELDS, accumulate(bits // 8 for _, bits in HEADER_FIELDS), strict=True
    )
}
_CODES = {8: "B", 16: "H", 32: "I", 64: "Q"}
_STRUCT = struct.Struct("!" + "".join(_CODES[bits] for _, bits in HEADER_FIELDS))
_CHECKED = struct.Struct("!" + "".join(_CODES[bits] for _, bits in HEADER_FIELDS[:-1]))
HEADER_SIZE = _STRUCT.size
CHECKED_SIZE = _CHECKED.size  # the checksum covers every header byte before it, and the meta
assert HEADER_SIZE == 64 == sum(bits for _, bits in HEADER_FIELDS) // 8

MAGIC = b"NICO"
MAGIC_U32 = int.from_bytes(MAGIC, "big")
VERSION = 1
MAX_DIMS = 4
MAX_META = 64 * 1024
MAX_PAYLOAD = 1 << 30


class Kind(IntEnum):
    """What a frame is for; the value is the `kind` byte on the wire."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    ERROR = 5
    LOAD = 6
    DATA = 7
    CREDIT = 8
    REQUEST = 9
    RESULT = 10
    STATS = 11
    DRAIN = 12
    SHUTDOWN = 13
    HEARTBEAT = 14
    ACK = 15


class Flag(IntFlag):
    """Bits of the `flags` field; any other bit set is a malformed frame."""

    OUT_OF_BAND = 0x1  # the payload was written into the receiver's slot; it does not follow


OUT_OF_BAND = int(Flag.OUT_OF_BAND)  # as a plain int: IntFlag arithmetic is slow per batch


class DType(IntEnum):
    """Element type code of a tensor; NONE means raw bytes. Payloads are little-endian."""

    NONE = 0
    UINT8 = 1
    INT8 = 2
    UINT16 = 3
    INT16 = 4
    UINT32 = 5
    INT32 = 6
    INT64 = 7
    UINT64 = 8
    FLOAT16 = 9
    FLOAT32 = 10
    FLOAT64 = 11
    BOOL = 12

    @property
    def numpy(self) -> np.dtype:
        if self is DType.NONE:
            return np.dtype(np.uint8)
        return _TO_NUMPY[self]

    @classmethod
    def of(cls, dtype: np.dtype | type | str) -> DType:
        """The code of a numpy dtype; ValueError for a type the wire cannot carry."""
        dt = np.dtype(dtype)
        code = _FROM_NUMPY.get(dt)
        if code is None:
            names = ", ".join(str(d) for d in _FROM_NUMPY)
            raise ValueError(f"dtype {dt.str} cannot be sent; supported: {names}")
        return code


# Native order: every platform nicoffload targets (x86-64, Arm DPUs) is little-endian.
_TO_NUMPY = {code: np.dtype(code.name.lower()) for code in DType if code.value}
_FROM_NUMPY = {dt: code for code, dt in _TO_NUMPY.items()}


def _bad(field: str, message: str) -> FrameError:
    exc = FrameError(f"malformed frame: {field}: {message}")
    exc.field = field  # type: ignore[attr-defined]
    return exc


@dataclass(frozen=True)
class Header:
    """The fixed part of a frame. `shape` is the per-item shape (the batch dim is batch_size)."""

    kind: Kind
    flags: int = 0
    pipeline_id: int = 0
    stage_id: int = 0
    slot: int = 0
    request_id: int = 0
    batch_size: int = 0
    meta_len: int = 0
    payload_len: int = 0
    dtype: DType = DType.NONE
    shape: tuple[int, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def pack(self, meta: bytes = b"") -> bytes:
        """The 64 header bytes; `meta` is the blob that follows (the checksum covers it)."""
        if len(meta) != self.meta_len:
            raise ValueError(f"meta is {len(meta)} bytes but meta_len is {self.meta_len}")
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"shape {self.shape} has more than {MAX_DIMS} dims")
        s = (*self.shape, 0, 0, 0, 0)
        fields = (
            MAGIC_U32,
            VERSION,
            self.kind,
            self.flags,
            self.pipeline_id,
            self.stage_id,
            self.slot,
            self.request_id,
            self.batch_size,
            self.meta_len,
            self.payload_len,
            self.dtype,
            len(self.shape),
            0,
            s[0],
            s[1],
            s[2],
            s[3],
        )
        try:
            head = _CHECKED.pack(*fields)
        except struct.error as exc:
            raise ValueError(f"header field out of range: {self!r}") from exc
        crc = zlib.crc32(meta, zlib.crc32(head))
        return head + crc.to_bytes(4, "big")

    @classmethod
    def unpack(
        cls, buf: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD
    ) -> Header:
        """Parse and validate the header and metadata blob at the start of `buf`.

        `buf` must hold at least HEADER_SIZE + meta_len bytes (what `head_size` says); any
        payload after them is not looked at. Every violation raises FrameError naming the field.
        """
        if len(buf) < HEADER_SIZE:
            raise _bad("magic", f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
        (
            magic,
            version,
            kind,
            flags,
            pipeline_id,
            stage_id,
            slot,
            request_id,
            batch_size,
            meta_len,
            payload_len,
            dtype,
            ndim,
            reserved,
            *dims,
            checksum,
        ) = _STRUCT.unpack_from(buf)
        _check_prefix(magic, version, meta_len)
        size = HEADER_SIZE + meta_len
        if len(buf) < size:
            raise _bad("meta_len", f"truncated metadata: {len(buf) - HEADER_SIZE} of {meta_len}")
        crc = zlib.crc32(buf[HEADER_SIZE:size], zlib.crc32(buf[:CHECKED_SIZE]))
        if crc != checksum:
            raise _bad("checksum", f"{checksum:#010x} on the wire, {crc:#010x} computed")
        if kind not in _KINDS:
            raise _bad("kind", f"unknown kind {kind}")
        if flags & ~_FLAGS:
            raise _bad("flags", f"unknown bits {flags & ~_FLAGS:#06x}")
        if dtype not in _DTYPES:
            raise _bad("dtype", f"unknown dtype code {dtype}")
        if ndim > MAX_DIMS:
            raise _bad("ndim", f"{ndim} > {MAX_DIMS}")
        if reserved:
            raise _bad("reserved", f"{reserved:#06x}, must be 0")
        for i in range(ndim, MAX_DIMS):
            if dims[i]:
                raise _bad(f"shape{i}", f"{dims[i]}, but ndim is {ndim} (unused dims must be 0)")
        if payload_len > max_payload:
            raise _bad("payload_len", f"{payload_len} exceeds the limit of {max_payload}")
        shape = tuple(dims[:ndim])
        if dtype:
            expected = batch_size * math.prod(shape) * _TO_NUMPY[dtype].itemsize
            if payload_len != expected:
                raise _bad(
                    "payload_len",
                    f"{payload_len}, but batch_size x shape x itemsize "
                    f"= {batch_size} x {shape} x {_TO_NUMPY[dtype].itemsize} = {expected}",
                )
        elif ndim:
            raise _bad("ndim", f"{ndim} with dtype NONE (raw bytes have no shape)")
        # Bypasses the frozen dataclass __init__, which costs more than all the checks above.
        obj = object.__new__(cls)
        obj.__dict__.update(
            kind=_KINDS[kind],
            flags=flags,
            pipeline_id=pipeline_id,
            stage_id=stage_id,
            slot=slot,
            request_id=request_id,
            batch_size=batch_size,
            meta_len=meta_len,
            payload_len=payload_len,
            dtype=_DTYPES[dtype],
            shape=shape,
        )
        return obj


_KINDS = {k.value: k for k in Kind}
_DTYPES = {d.value: d for d in DType}
_FLAGS = int(Flag.OUT_OF_BAND)


def head_size(buf: bytes | bytearray | memoryview) -> int:
    """HEADER_SIZE + meta_len, read from a frame's first bytes (checks length, magic, version)."""
    if len(buf) < HEADER_SIZE:
        raise _bad("magic", f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, meta_len = _PREFIX.unpack_from(buf)
    _check_prefix(magic, version, meta_len)
    return HEADER_SIZE + meta_len


# magic, version, meta_len: all a stream reader needs to find the end of a frame's head
_PREFIX = struct.Struct(f"!IB{FIELD_OFFSETS['meta_len'] - 5}xI")


def _check_prefix(magic: int, version: int, meta_len: int) -> None:
    if magic != MAGIC_U32:
        raise _bad("magic", f"{magic.to_bytes(4, 'big')!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _bad("version", f"{version}, this side speaks version {VERSION}")
    if meta_len > MAX_META:
        raise _bad("meta_len", f"{meta_len} exceeds the limit of {MAX_META}")


# slot and request_id sit side by side: a sender restamps them into a cached frame head
_SLOT_REQUEST = struct.Struct("!HQ")
assert FIELD_OFFSETS["request_id"] == FIELD_OFFSETS["slot"] + 2


def restamp(head: bytes, slot: int, request_id: int) -> bytearray:
    """A packed header + metadata with another slot and request_id and the checksum redone:
    per batch, cheaper than packing anew when a sender's batches all look alike."""
    out = bytearray(head)
    _SLOT_REQUEST.pack_into(out, FIELD_OFFSETS["slot"], slot, request_id)
    view = memoryview(out)
    crc = zlib.crc32(view[HEADER_SIZE:], zlib.crc32(view[:CHECKED_SIZE]))
    out[CHECKED_SIZE:HEADER_SIZE] = crc.to_bytes(4, "big")
    return out


# --- metadata ---------------------------------------------------------------------------------


class TensorEntry(msgspec.Struct, array_like=True, frozen=True):
    """Where one tensor of a DATA frame lies in the payload; `dtype` is a DType code."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int


class DataMeta(msgspec.Struct, array_like=True, frozen=True):
    """The metadata of a DATA frame: the tensors' layout in the slot and the sender's own meta."""

    tensors: tuple[TensorEntry, ...]
    user: dict[str, Any] = {}


class ErrorMeta(msgspec.Struct, frozen=True):
    """The metadata of an ERROR frame."""

    error: str
    message: str


class Hello(msgspec.Struct, frozen=True):
    """The metadata of a sender's HELLO: which transport it speaks; a sender with a key adds
    its nonce (a receiver with a key then challenges it: `transport.handshake`)."""

    transport: str
    nonce: bytes = b""


class Welcome(msgspec.Struct, frozen=True):
    """The metadata of a receiver's WELCOME: its ring, where the ring lives (shm), its proof."""

    slots: int
    slot_bytes: int
    segment: str = ""
    proof: bytes = b""  # a receiver with a key: it holds the key, over the nonces and the rest


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode_meta(obj: Any) -> bytes:
    """msgpack-encode a metadata object; ValueError if it cannot be or exceeds MAX_META."""
    try:
        blob = _encoder.encode(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"metadata cannot be encoded as msgpack: {exc}") from exc
    if len(blob) > MAX_META:
        raise ValueError(f"metadata is {len(blob)} bytes, more than MAX_META={MAX_META}")
    return blob


def decode_meta(blob: bytes | memoryview, type_: Any = Any) -> Any:
    """Decode a metadata blob into `type_` (validated by msgspec); FrameError if malformed."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    try:
        return decoder.decode(blob)
    except (msgspec.DecodeError, RecursionError) as exc:  # a deep-nesting bomb is malformed too
        raise _bad("meta", str(exc)) from exc


def encode(header: Header, meta: Any = None) -> bytes:
    """Header and metadata blob of one frame (`header.meta_len` is set from the blob)."""
    blob = b"" if meta is None else encode_meta(meta)
    if header.meta_len != len(blob):
        header = replace(header, meta_len=len(blob))
    return header.pack(blob) + blob


def error_frame(exc: BaseException, *, request_id: int = 0, slot: int = 0) -> bytes:
    """An ERROR frame that carries `exc`'s type and message (never the object itself)."""
    message = str(exc)[: MAX_META // 8]  # 4 bytes a character at most in UTF-8: it fits
    return encode(
        Header(Kind.ERROR, slot=slot, request_id=request_id), ErrorMeta(type(exc).__name__, message)
    )


def error_from_frame(blob: bytes | memoryview, peer: str = "peer") -> TransportError:
    """The exception an ERROR frame's metadata describes, to raise on this side."""
    meta = decode_meta(blob, ErrorMeta)
    return TransportError(f"{peer} failed: {meta.error}: {meta.message}")
