"""The agent's link to a worker process (`procs.Link`): a message comes whole or not at all, a
peer gone in the middle of one is an EOFError (the worker is taken as lost and restarted), and
a length over MAX_MESSAGE is refused before a byte of it is allocated or read."""

from __future__ import annotations

import socket
import struct

import pytest

from dpu_agents.procs import MAX_MESSAGE, Link


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield Link(a), b
    a.close()
    b.close()


def test_a_message_comes_whole(pair) -> None:
    link, other = pair
    Link(other).send(["done", [[1, "", "", ["x"], []]], [0.5], 1, 2, 3])
    assert link.recv() == ["done", [[1, "", "", ["x"], []]], [0.5], 1, 2, 3]


def test_a_peer_gone_in_the_middle_of_a_message_is_an_eof(pair) -> None:
    link, other = pair
    other.sendall(struct.pack("<Q", 1000) + b"\x90" * 10)  # 10 of the 1000 bytes, then gone
    other.close()
    with pytest.raises(EOFError, match="closed"):
        link.recv()


def test_a_length_over_max_message_is_refused_before_it_is_read(pair) -> None:
    link, other = pair
    other.sendall(struct.pack("<Q", MAX_MESSAGE + 1))  # and nothing after it: no wait for it
    with pytest.raises(EOFError, match=f"a message of {MAX_MESSAGE + 1} bytes"):
        link.recv()
    assert MAX_MESSAGE <= 64 << 20  # control messages only: values cross in the arenas
