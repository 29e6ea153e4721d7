"""Frame integrity on a secured Channel: every frame's MAC covers its header, metadata and
payload and its place in the stream, so an altered, replayed, reordered, reflected or untagged
frame is a FrameError (field `mac`) and never reaches the caller as a header or a payload."""

from __future__ import annotations

import os
import socket
import threading
import zlib

import numpy as np
import pytest

from nicoffload.agent import auth
from nicoffload.errors import FrameError
from nicoffload.transport.channel import MAC_PIECE, Channel
from nicoffload.transport.frame import (
    CHECKED_SIZE,
    FIELD_OFFSETS,
    HEADER_SIZE,
    OUT_OF_BAND,
    DType,
    Header,
    Kind,
    encode,
)
from nicoffload.transport.integrity import TAG_BYTES, FrameMac, hkdf

A_KEY, B_KEY = os.urandom(32), os.urandom(32)  # the keys of A's frames and of B's frames
PAYLOAD = np.arange(1000, dtype=np.uint8)


def data_head(request_id: int = 7, meta: dict | None = None, flags: int = 0) -> bytes:
    header = Header(
        Kind.DATA,
        flags=flags,
        request_id=request_id,
        batch_size=1,
        payload_len=PAYLOAD.nbytes,
        dtype=DType.UINT8,
        shape=(PAYLOAD.nbytes,),
    )
    return encode(header, meta or {"tensors": [["x", 1, [1000], 0]]})


def wire(send) -> bytes:
    """The bytes A's secured channel puts on the wire for `send(channel)`."""
    a, b = socket.socketpair()
    ch = Channel(a, "A")
    ch.secure(A_KEY, B_KEY)
    try:
        send(ch)
        a.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := b.recv(1 << 16):
            out += chunk
        return out
    finally:
        ch.close()
        b.close()


def reader(data: bytes, *, send_key: bytes = B_KEY, recv_key: bytes = A_KEY) -> Channel:
    """B's secured channel, reading `data` (then EOF)."""
    a, b = socket.socketpair()
    b.sendall(data)
    b.close()
    ch = Channel(a, "B", io_timeout=2)
    ch.secure(send_key, recv_key)
    return ch


def read_frame(ch: Channel) -> tuple[Header, bytes, np.ndarray]:
    got = ch.read_head(1 << 20)
    assert got is not None
    header, meta = got
    out = np.zeros(header.payload_len if not header.flags & OUT_OF_BAND else 0, np.uint8)
    ch.read_into(memoryview(out))
    return header, meta, out


def recrc(frame: bytearray) -> bytearray:
    """The frame with its CRC made right again: what a relay does, so only the MAC can tell."""
    meta_len = int.from_bytes(frame[FIELD_OFFSETS["meta_len"] : FIELD_OFFSETS["meta_len"] + 4])
    crc = zlib.crc32(frame[HEADER_SIZE : HEADER_SIZE + meta_len], zlib.crc32(frame[:CHECKED_SIZE]))
    frame[CHECKED_SIZE:HEADER_SIZE] = crc.to_bytes(4, "big")
    return frame


def assert_mac_fails(ch: Channel) -> None:
    with pytest.raises(FrameError, match="mac") as info:
        read_frame(ch)
    assert info.value.field == "mac"
    ch.close()


def test_secured_frames_round_trip_with_their_payload() -> None:
    data = wire(lambda ch: [ch.send(data_head(i), [PAYLOAD]) for i in range(3)])
    ch = reader(data)
    for i in range(3):
        header, _, payload = read_frame(ch)
        assert header.request_id == i
        np.testing.assert_array_equal(payload, PAYLOAD)
    assert ch.read_head(0) is None
    ch.close()


class CountingSocket:
    """A socket that counts its sendmsg calls (a frame split over several can leave the
    receiver waiting mid-frame on a sender that was descheduled between them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.calls = sock, 0

    def sendmsg(self, *args):
        self.calls += 1
        return self.sock.sendmsg(*args)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


@pytest.mark.parametrize("size", [1, 1000, MAC_PIECE - 200, 3 * MAC_PIECE + 17])
def test_a_frame_goes_in_as_few_writes_as_its_pieces_and_round_trips(size: int) -> None:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    head = encode(
        Header(
            Kind.DATA,
            request_id=3,
            batch_size=1,
            payload_len=size,
            dtype=DType.UINT8,
            shape=(size,),
        ),
        {"tensors": [["x", 1, [size], 0]]},
    )
    a, b = socket.socketpair()
    counting = CountingSocket(a)
    ch = Channel(a, "A")
    ch.sock = counting
    ch.secure(A_KEY, B_KEY)
    rx = Channel(b, "B", io_timeout=10)
    rx.secure(B_KEY, A_KEY)
    sender = threading.Thread(target=ch.send, args=(head, [payload]))
    sender.start()
    header, _, got = read_frame(rx)
    sender.join(10)
    ch.close()
    rx.close()
    assert header.request_id == 3
    np.testing.assert_array_equal(got, payload)
    pieces = -(-(len(head) + size) // MAC_PIECE)
    assert counting.calls <= pieces + 1, (counting.calls, pieces)
    if len(head) + size <= MAC_PIECE:
        assert counting.calls == 1  # the head, the payload and the tag together


def test_each_frame_is_followed_by_its_tag() -> None:
    head = encode(Header(Kind.HEARTBEAT))
    data = wire(lambda ch: ch.send(head))
    assert data[:HEADER_SIZE] == head and len(data) == HEADER_SIZE + TAG_BYTES
    assert data[HEADER_SIZE:] == FrameMac(A_KEY).tag([head])


def test_a_payload_read_in_pieces_is_checked_when_its_last_byte_is_in() -> None:
    ch = reader(wire(lambda ch: ch.send(data_head(), [PAYLOAD])))
    header, _ = ch.read_head(1 << 20)
    out = memoryview(np.zeros(header.payload_len, np.uint8))
    for at in range(0, header.payload_len, 300):
        ch.read_into(out[at : at + 300])
    np.testing.assert_array_equal(np.asarray(out), PAYLOAD)
    ch.close()


@pytest.mark.parametrize(
    "where", [FIELD_OFFSETS["request_id"] + 7, FIELD_OFFSETS["slot"], HEADER_SIZE + 3]
)
def test_an_altered_header_or_meta_byte_is_refused_though_the_crc_is_right(where: int) -> None:
    frame = bytearray(wire(lambda ch: ch.send(data_head(), [PAYLOAD])))
    frame[where] ^= 0x01
    assert_mac_fails(reader(bytes(recrc(frame))))


def test_an_altered_payload_byte_never_comes_out_as_a_tensor() -> None:
    frame = bytearray(wire(lambda ch: ch.send(data_head(), [PAYLOAD])))
    frame[-TAG_BYTES - 500] ^= 0x80
    assert_mac_fails(reader(bytes(frame)))


def test_an_altered_tag_is_refused() -> None:
    frame = bytearray(wire(lambda ch: ch.send(encode(Header(Kind.SHUTDOWN)))))
    frame[-1] ^= 0x01
    ch = reader(bytes(frame))
    with pytest.raises(FrameError, match="mac"):
        ch.read_head(0)  # a frame with no payload is checked before it is returned
    ch.close()


def test_an_untagged_frame_is_refused() -> None:
    plain = encode(Header(Kind.SHUTDOWN)) + encode(Header(Kind.HEARTBEAT))
    ch = reader(plain)
    with pytest.raises(FrameError, match="mac"):
        ch.read_head(0)
    ch.close()


def test_a_replayed_frame_is_refused() -> None:
    one = wire(lambda ch: ch.send(encode(Header(Kind.HEARTBEAT, request_id=1))))
    ch = reader(one + one)
    assert ch.read_head(0)[0].request_id == 1
    with pytest.raises(FrameError, match="mac"):
        ch.read_head(0)
    ch.close()


def test_reordered_frames_are_refused() -> None:
    frames = [encode(Header(Kind.HEARTBEAT, request_id=i)) for i in (1, 2)]
    data = wire(lambda ch: [ch.send(f) for f in frames])
    size = HEADER_SIZE + TAG_BYTES
    ch = reader(data[size:] + data[:size])
    with pytest.raises(FrameError, match="mac"):
        ch.read_head(0)
    ch.close()


def test_a_frame_reflected_back_to_its_sender_is_refused() -> None:
    data = wire(lambda ch: ch.send(encode(Header(Kind.SHUTDOWN))))
    ch = reader(data, send_key=A_KEY, recv_key=B_KEY)  # A reading its own frame
    with pytest.raises(FrameError, match="mac"):
        ch.read_head(0)
    ch.close()


def test_out_of_band_frames_are_checked_at_once_and_several_go_in_one_write() -> None:
    heads = [data_head(i, flags=OUT_OF_BAND) for i in range(3)]
    ch = reader(wire(lambda ch: ch.send_frames(heads)))
    assert [read_frame(ch)[0].request_id for _ in range(3)] == [0, 1, 2]
    ch.close()


def test_an_unsecured_channel_sends_and_reads_plain_frames() -> None:
    a, b = socket.socketpair()
    ch = Channel(a, "plain")
    ch.send(encode(Header(Kind.HEARTBEAT)))
    assert b.recv(1024) == encode(Header(Kind.HEARTBEAT))
    ch.close()
    b.close()


def test_hkdf_matches_rfc_5869_test_case_1() -> None:
    okm = hkdf(
        bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
        bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42,
    )  # fmt: skip
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )


def test_session_keys_depend_on_nonces_token_and_transcript() -> None:
    token, na, nc, t = b"t" * 32, b"a" * 32, b"c" * 32, b"x" * 32
    keys = auth.session_keys(token, na, nc, t)
    assert len({keys.client, keys.agent, keys.forward}) == 3
    assert keys == auth.session_keys(token, na, nc, t)
    for other in (
        auth.session_keys(b"u" * 32, na, nc, t),
        auth.session_keys(token, b"b" * 32, nc, t),
        auth.session_keys(token, na, b"d" * 32, t),
        auth.session_keys(token, na, nc, b"y" * 32),  # a handshake frame altered on the way
    ):
        assert not set(other) & set(keys)
