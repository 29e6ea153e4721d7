"""The agent's link to a worker process (`link.Link`): a message comes whole or not at all, a
peer gone in the middle of one is an EOFError (the worker is taken as lost and restarted), and
a length over MAX_MESSAGE is refused before a byte of it is allocated or read; a worker's reply
stays far inside it, whatever a failing kernel says."""

from __future__ import annotations

import socket
import struct

import pytest

from dpu_agents.link import MAX_MESSAGE, Link
from dpu_agents.worker import DETAIL_CHARS, Worker
from nicoffload.errors import ItemError


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


class _Failing:
    """A stage whose every row fails with a detail of `n` characters."""

    def __init__(self, n: int, error: type[Exception]) -> None:
        self.n, self.error = n, error

    def process(self, values, outs, tally):
        if self.error is ItemError:
            raise ItemError("bad_input", "x" * self.n)
        raise self.error("y" * self.n)


@pytest.mark.parametrize("error", [ItemError, RuntimeError])
def test_a_failed_rows_detail_is_cut_so_a_reply_stays_inside_max_message(error) -> None:
    result, outs = Worker._row(_Failing(1 << 22, error), {}, 3, {}, [], None)
    assert result[0] == 3 and result[1] in ("bad_input", "internal") and outs == []
    assert len(result[2]) == DETAIL_CHARS
