"""The wire format: layout, round trips, and that bad bytes only ever raise FrameError."""

from __future__ import annotations

import contextlib
import math
import pickle
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport import frame
from nicoffload.transport.frame import (
    FIELD_OFFSETS,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAX_META,
    DType,
    Flag,
    Header,
    Kind,
    decode_meta,
    encode,
    encode_meta,
    error_frame,
    error_from_frame,
    head_size,
)
from nicoffload.transport.slots import Unpacker

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
U = {name: (1 << bits) - 1 for name, bits in HEADER_FIELDS}


_IDS = struct.Struct("!BBBBIHHQIQ4B")  # one binary draw makes a header: cheap to generate


@st.composite
def headers(draw: st.DrawFn) -> Header:
    """Valid headers: dtype, shape, batch_size and payload_len consistent."""
    k, flags, d, ndim, pipeline, stage, slot, request, batch, payload, *dims = _IDS.unpack(
        draw(st.binary(min_size=_IDS.size, max_size=_IDS.size))
    )
    dtype = DType(d % len(DType))
    shape = tuple(dims[: ndim % 5]) if dtype else ()
    if dtype:
        batch %= 256
        payload = batch * math.prod(shape) * dtype.numpy.itemsize
    return Header(
        Kind(k % len(Kind) + 1),
        flags & Flag.OUT_OF_BAND,
        pipeline,
        stage,
        slot,
        request,
        batch,
        0,
        payload,
        dtype,
        shape,
    )


def wire(header: Header, meta: bytes = b"") -> bytes:
    header = Header(**{**header.__dict__, "meta_len": len(meta)})
    return header.pack(meta) + meta


def forge(**fields: int) -> bytes:
    """A header with any field values and a correct checksum: reaches the semantic checks."""
    values = {name: 0 for name, _ in HEADER_FIELDS}
    values.update(magic=frame.MAGIC_U32, version=frame.VERSION, kind=Kind.HELLO)
    values.update(fields)
    fmt = "!" + "".join({8: "B", 16: "H", 32: "I", 64: "Q"}[b] for _, b in HEADER_FIELDS)
    raw = struct.pack(fmt, *(values[name] for name, _ in HEADER_FIELDS))
    return raw[:60] + zlib.crc32(raw[:60]).to_bytes(4, "big")


def test_header_fields_make_64_bytes_in_network_order() -> None:
    assert sum(bits for _, bits in HEADER_FIELDS) == 8 * HEADER_SIZE == 512
    raw = Header(Kind.DATA, request_id=0x0102030405060708, slot=0x0A0B).pack()
    assert raw[:4] == b"NICO"
    assert raw[FIELD_OFFSETS["request_id"] :][:8] == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert raw[FIELD_OFFSETS["slot"] :][:2] == b"\x0a\x0b"
    assert raw[FIELD_OFFSETS["kind"]] == Kind.DATA


def test_checksum_is_crc32_of_the_other_header_bytes_and_the_metadata() -> None:
    raw = wire(Header(Kind.HELLO), b"meta")
    assert raw[60:64] == zlib.crc32(raw[:60] + b"meta").to_bytes(4, "big")


@settings(FAST, max_examples=300)
@given(headers(), st.binary(max_size=300))
def test_pack_then_unpack_gives_the_same_header(header: Header, meta: bytes) -> None:
    raw = wire(header, meta)
    got = Header.unpack(raw, max_payload=U["payload_len"])
    assert got == Header(**{**header.__dict__, "meta_len": len(meta)})
    assert head_size(raw) == HEADER_SIZE + len(meta)


@settings(FAST, max_examples=800)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_frame_error(data: bytes) -> None:
    with pytest.raises(FrameError):
        Header.unpack(data)


@settings(FAST, max_examples=400)
@given(headers(), st.binary(max_size=64), st.data())
def test_any_single_bit_flip_is_caught(header: Header, meta: bytes, data: st.DataObject) -> None:
    raw = bytearray(wire(header, meta))
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        Header.unpack(raw, max_payload=U["payload_len"])


@settings(FAST, max_examples=300)
@given(headers(), st.binary(min_size=1, max_size=64), st.data())
def test_truncated_frames_raise_frame_error(
    header: Header, meta: bytes, data: st.DataObject
) -> None:
    raw = wire(header, meta)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(FrameError):
        Header.unpack(raw[:cut])


@settings(FAST, max_examples=400)
@given(st.binary(min_size=60, max_size=60 + 64), st.integers(0, 1 << 40))
def test_random_frames_with_valid_checksums_raise_only_frame_error(data: bytes, limit: int) -> None:
    meta = data[60:]
    head = b"NICO\x01" + data[5:28] + len(meta).to_bytes(4, "big") + data[32:60]
    raw = head + zlib.crc32(head + meta).to_bytes(4, "big") + meta
    with contextlib.suppress(FrameError):
        Header.unpack(raw, max_payload=limit)


_JSONISH = st.recursive(
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.booleans(),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(st.text(max_size=4), inner).map(list),
    max_leaves=20,
)


_ENTRY = st.tuples(
    st.sampled_from(["a", "b"]),
    st.integers(-2, 14),
    st.lists(st.integers(-2, 2**34), max_size=40),
    st.integers(-5, 2**40),
).map(list)
_DATA_META = st.lists(_ENTRY, max_size=3).map(lambda tensors: encode_meta([tensors, {}]))


@settings(FAST, max_examples=300)
@given(
    st.one_of(st.binary(max_size=100), _JSONISH.map(encode_meta), _DATA_META), st.integers(0, 4096)
)
def test_random_data_metadata_raises_only_frame_error(meta: bytes, payload_len: int) -> None:
    ring = np.zeros(4 * 4096, np.uint8)
    header = Header(Kind.DATA, slot=1, payload_len=payload_len, meta_len=len(meta))
    with contextlib.suppress(FrameError):
        Unpacker(ring, 4096)(header, meta)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"NICO", "magic"),
        (b"NICX" + forge()[4:], "magic"),
        (forge(version=2), "version"),
        (forge(meta_len=MAX_META + 1), "meta_len"),
        (forge(meta_len=10), "meta_len"),
        (forge(kind=0), "kind"),
        (forge(kind=99), "kind"),
        (forge(flags=0x8000), "flags"),
        (forge(dtype=13), "dtype"),
        (forge(dtype=1, ndim=5), "ndim"),
        (forge(ndim=1, shape0=3), "ndim"),
        (forge(reserved=1), "reserved"),
        (forge(dtype=1, ndim=1, shape0=2, shape2=7), "shape2"),
        (forge(payload_len=(1 << 30) + 1), "payload_len"),
        (forge(dtype=10, ndim=2, shape0=3, shape1=4, batch_size=2, payload_len=95), "payload_len"),
        (forge()[:60] + b"\0\0\0\0", "checksum"),
    ],
)
def test_each_violation_names_its_field(raw: bytes, field: str) -> None:
    with pytest.raises(FrameError, match=f"malformed frame: {field}:") as info:
        Header.unpack(raw)
    assert info.value.field == field


def test_consistent_dtype_shape_and_payload_are_accepted() -> None:
    raw = forge(dtype=10, ndim=2, shape0=3, shape1=4, batch_size=2, payload_len=96)
    assert Header.unpack(raw).shape == (3, 4)


def test_payload_limit_is_the_callers() -> None:
    raw = Header(Kind.DATA, payload_len=4097).pack()
    assert Header.unpack(raw).payload_len == 4097
    with pytest.raises(FrameError, match="payload_len: 4097 exceeds the limit of 4096"):
        Header.unpack(raw, max_payload=4096)


def test_meta_round_trips_through_msgpack() -> None:
    blob = encode_meta({"a": [1, 2.5, "x"], "b": {"c": None}})
    assert decode_meta(blob) == {"a": [1, 2.5, "x"], "b": {"c": None}}


def test_meta_larger_than_max_meta_is_refused() -> None:
    with pytest.raises(ValueError, match="MAX_META"):
        encode_meta({"x": "a" * MAX_META})


def test_deeply_nested_meta_is_a_frame_error() -> None:
    with pytest.raises(FrameError, match="meta"):
        decode_meta(b"\x91" * (MAX_META - 1) + b"\xc0")


def test_meta_is_never_unpickled() -> None:
    with pytest.raises(FrameError, match="meta"):
        decode_meta(pickle.dumps(object()) + b"\xc1")


def test_encode_sets_meta_len_from_the_blob() -> None:
    raw = encode(Header(Kind.STATS), {"items": 3})
    header = Header.unpack(raw)
    assert decode_meta(raw[HEADER_SIZE : HEADER_SIZE + header.meta_len]) == {"items": 3}


def test_error_frame_carries_type_and_message_back() -> None:
    raw = error_frame(ValueError("bad pixels"), request_id=9)
    header = Header.unpack(raw)
    assert (header.kind, header.request_id) == (Kind.ERROR, 9)
    exc = error_from_frame(raw[HEADER_SIZE:], "agent")
    assert isinstance(exc, TransportError)
    assert str(exc) == "agent failed: ValueError: bad pixels"


@pytest.mark.parametrize("code", [d for d in DType if d is not DType.NONE])
def test_dtype_codes_map_to_numpy_and_back(code: DType) -> None:
    assert DType.of(code.numpy) is code


@pytest.mark.parametrize("dtype", [np.complex64, object, ">f4"])
def test_dtypes_the_wire_cannot_carry_are_refused(dtype: object) -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        DType.of(dtype)
