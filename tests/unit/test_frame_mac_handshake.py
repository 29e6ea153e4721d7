"""The data channel's handshake (`transport.handshake`): a receiver with a key takes only a
sender that proves it, and then every frame between them carries a MAC; the sender's side of
the handshake is bounded by its timeout, however the peer stalls."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from nicoffload.errors import TransportError
from nicoffload.transport import connect, listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import Header, Hello, Kind, Welcome, decode_meta, encode
from nicoffload.transport.handshake import expect
from nicoffload.transport.integrity import DataAuth, DataChallenge, nonce, sender_proof

KEY = os.urandom(32)


@pytest.fixture(params=["tcp", "shm"])
def address(request: pytest.FixtureRequest) -> str:
    if request.param == "tcp":
        return "tcp://127.0.0.1:0"
    return f"shm://mac-{os.getpid()}-{time.monotonic_ns()}"


def test_a_sender_with_the_key_attaches_and_its_frames_carry_a_mac(address: str) -> None:
    with (
        listen(address, slots=2, slot_bytes=1 << 16, key=KEY) as rx,
        connect(rx.address, timeout=5, key=KEY) as tx,
    ):
        tx.send({"x": np.arange(100, dtype=np.int32)}, request_id=3)
        d = rx.recv(timeout=5)
        assert d.request_id == 3 and d.tensors["x"].sum() == 4950
        assert tx._ch.secured and rx._ch.secured
        rx.release(d)
        tx.flush(5)


@pytest.mark.parametrize("key", [None, os.urandom(32)], ids=["no key", "another key"])
def test_a_sender_without_the_key_is_refused_and_the_right_one_still_attaches(
    address: str, key: bytes | None
) -> None:
    with listen(address, slots=2, slot_bytes=1 << 16, key=KEY) as rx:
        with pytest.raises(TransportError, match=r"authenticates its sender|does not hold"):
            connect(rx.address, timeout=5, key=key)
        with connect(rx.address, timeout=5, key=KEY) as tx:
            tx.send({"x": np.zeros(4, np.uint8)})
            rx.release(rx.recv(timeout=5))


def test_a_keyed_sender_goes_on_unauthenticated_with_a_receiver_that_has_no_key(
    address: str,
) -> None:
    with (
        listen(address, slots=2, slot_bytes=1 << 16) as rx,
        connect(rx.address, timeout=5, key=KEY) as tx,
    ):
        tx.send({"x": np.zeros(4, np.uint8)})
        rx.release(rx.recv(timeout=5))
        assert not tx._ch.secured


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        listen("tcp://127.0.0.1:0", slots=1, slot_bytes=64, key=b"short")


@pytest.mark.parametrize("says", [b"SSH-2.0-OpenSSH_9.6\r\n", b""])
def test_the_senders_handshake_ends_within_its_timeout_whatever_the_peer_sends(says) -> None:
    """A peer that answers HELLO with a few bytes of something else (a banner shorter than a
    frame header), or nothing, fails the connect within its timeout, not IO_TIMEOUT (30 s)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        sock, _ = server.accept()
        held.append(sock)
        sock.sendall(says)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransportError):
            connect(f"tcp://127.0.0.1:{server.getsockname()[1]}", timeout=1.0, key=KEY)
        assert time.monotonic() - t0 < 3.0
    finally:
        thread.join(5)
        for s in [*held, server]:
            s.close()


def test_a_sender_answering_promptly_is_not_displaced_by_a_newcomer() -> None:
    """A stranger connects while a sender is between CHALLENGE and AUTH: a sender that answers
    within DISPLACE_AFTER still gets its WELCOME (only one that stalls gives way)."""
    with listen("tcp://127.0.0.1:0", slots=1, slot_bytes=64, key=KEY) as rx:
        host, port = rx.address.removeprefix("tcp://").rsplit(":", 1)
        ch = Channel(socket.create_connection((host, int(port))), "receiver", io_timeout=5)
        try:
            mine = nonce()
            ch.send(encode(Header(Kind.HELLO), Hello("tcp", mine)))
            theirs = decode_meta(expect(ch, Kind.CHALLENGE, 5), DataChallenge).nonce
            with socket.create_connection((host, int(port))):
                time.sleep(0.05)  # the newcomer is waiting at the listener
                ch.send(encode(Header(Kind.AUTH), DataAuth(sender_proof(KEY, mine, theirs))))
                assert decode_meta(expect(ch, Kind.WELCOME, 5), Welcome).proof
        finally:
            ch.close()
