"""The agent's link to one worker process: length-prefixed msgpack messages over a stream
socket (control only: the values cross in shared-memory arenas), a message past MAX_MESSAGE a
broken link; and how a value lies in an arena, as a message names it."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

BYTES, TENSOR, TEXT = 0, 1, 2  # how a value lies in the arena: bytes, an array, utf-8 text
MAX_MESSAGE = 64 << 20  # control only (values cross in the arenas): more is a broken link


class Link:
    """Length-prefixed msgpack messages over a stream socket."""

    _LEN = struct.Struct("<Q")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        head = self._LEN.pack(len(data))
        if len(data) < 65536:  # one write
            self.sock.sendall(head + data)
        else:  # no copy of a large one
            self.sock.sendall(head)
            self.sock.sendall(data)

    def recv(self) -> Any:
        (n,) = self._LEN.unpack(self._exact(self._LEN.size))
        if n > MAX_MESSAGE:
            raise EOFError(f"a message of {n} bytes")
        return msgspec.msgpack.decode(self._exact(n))

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the other end closed")
            got += k
        return buf
