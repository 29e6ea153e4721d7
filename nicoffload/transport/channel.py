"""A framed stream socket (TCP or Unix): buffered reads of frame heads, payloads read straight
into the caller's memory, gathered writes; the control channel of the socket transports.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from collections.abc import Sequence

import numpy as np

from nicoffload.errors import TransportError
from nicoffload.transport.frame import FIELD_OFFSETS, HEADER_SIZE, MAX_META, Header, head_size

STAGING = 2 * (HEADER_SIZE + MAX_META)  # read buffer: a whole frame head always fits
DIRECT = 32 * 1024  # payload remainders this big are read straight into the destination
READ_SIZE = 16 * 1024  # a read for a frame head asks for this much: many small frames at once
IO_TIMEOUT = 30.0  # a peer silent this long in the middle of a frame is gone
IOV_MAX = 1024
MEMO = 4096  # control frames (no metadata) remembered, parsed: a credit is parsed once
_NOSIGNAL = int(socket.MSG_NOSIGNAL)  # a peer gone is an error, not a SIGPIPE
_META_LEN = slice(FIELD_OFFSETS["meta_len"], FIELD_OFFSETS["meta_len"] + 4)


class Channel:
    """A connected stream socket carrying frames. One reader at a time; writers take a lock."""

    def __init__(self, sock: socket.socket, peer: str, io_timeout: float = IO_TIMEOUT) -> None:
        self.sock, self.peer = sock, peer
        self._buf = memoryview(bytearray(STAGING))
        self._start = self._end = 0
        self._wlock = threading.Lock()
        self._closed = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._memo: dict[bytes, Header] = {}
        # Kernel-side timeouts: no poll() per call, and a hung peer cannot block us for ever.
        tv = struct.pack("ll", int(io_timeout), int(io_timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def send(
        self, head: bytes | bytearray, payload: Sequence[np.ndarray] = (), flags: int = 0
    ) -> None:
        """Write a frame head and its payload buffers (gathered, no copy)."""
        flags |= _NOSIGNAL
        with self._wlock:
            if self._closed:
                raise TransportError(f"{self.peer}: the connection is closed")
            try:
                if payload:
                    _send_all(self.sock, [memoryview(head), *map(memoryview, payload)], flags)
                else:
                    self.sock.sendall(head, flags)
            except BlockingIOError as exc:
                raise TransportError(f"{self.peer}: stopped reading for {IO_TIMEOUT} s") from exc
            except OSError as exc:
                raise TransportError(f"{self.peer}: send failed: {exc}") from exc

    def post(self, head: bytes, flags: int = 0) -> bool:
        """Best-effort send of a control frame: False (not an error) if the peer is gone."""
        try:
            self.send(head, flags=flags)
        except TransportError:
            return False
        return True

    def readable(self, timeout: float | None) -> bool:
        """Whether a frame (or EOF) is there to read, waiting up to `timeout` s (None: for ever)."""
        if self._end > self._start:
            return True
        ms = None if timeout is None else max(0, int(timeout * 1000))
        return bool(self._poll.poll(ms))

    def read_head(self, max_payload: int) -> tuple[Header, bytes] | None:
        """The next frame's header and metadata blob; None on a clean EOF between frames."""
        if not self._fill(HEADER_SIZE, boundary=True):
            return None
        at = self._start
        if self._buf[at + _META_LEN.start : at + _META_LEN.stop] == b"\0\0\0\0":
            raw = bytes(self._buf[at : at + HEADER_SIZE])
            header = self._memo.get(raw)
            if header is None or header.payload_len > max_payload:
                header = Header.unpack(raw, max_payload=max_payload)
                if len(self._memo) >= MEMO:
                    self._memo.clear()
                self._memo[raw] = header
            self._start += HEADER_SIZE
            return header, b""
        size = head_size(self._buf[at : at + HEADER_SIZE])
        self._fill(size)
        head = self._buf[self._start : self._start + size]
        header = Header.unpack(head, max_payload=max_payload)
        self._start += size
        return header, bytes(head[HEADER_SIZE:])

    def read_into(self, dst: memoryview) -> None:
        """Read exactly len(dst) payload bytes into dst: large runs straight from the socket."""
        n = len(dst)
        got = min(n, self._end - self._start)
        dst[:got] = self._buf[self._start : self._start + got]
        self._start += got
        while got < n:
            if n - got >= DIRECT:
                got += self._recv(dst[got:], mid_frame=True)
            else:
                self._fill(1)
                k = min(n - got, self._end - self._start)
                dst[got : got + k] = self._buf[self._start : self._start + k]
                self._start += k
                got += k

    def _fill(self, n: int, boundary: bool = False) -> bool:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start + n > STAGING:
            rest = bytes(self._buf[self._start : self._end])
            self._buf[: len(rest)] = rest
            self._start, self._end = 0, len(rest)
        while self._end - self._start < n:
            at_boundary = boundary and self._start == self._end
            # Read what this frame head needs and a little more: more would drag payload bytes
            # through the staging buffer (a second copy) instead of straight into the slot.
            stop = min(STAGING, max(self._end + READ_SIZE, self._start + n))
            k = self._recv(self._buf[self._end : stop], mid_frame=not at_boundary)
            if k == 0:
                return False
            self._end += k
        return True

    def _recv(self, view: memoryview, mid_frame: bool) -> int:
        while True:
            try:
                k = self.sock.recv_into(view)
            except BlockingIOError as exc:  # SO_RCVTIMEO: idle between frames is fine
                if not mid_frame:
                    continue
                raise TransportError(f"{self.peer}: silent for {IO_TIMEOUT} s mid-frame") from exc
            except OSError as exc:
                raise TransportError(f"{self.peer}: receive failed: {exc}") from exc
            if k == 0 and mid_frame:
                raise TransportError(f"{self.peer}: connection lost in the middle of a frame")
            return k

    def shutdown(self) -> None:
        """Wake a thread blocked on this socket (it then sees EOF)."""
        with contextlib.suppress(OSError):  # already disconnected
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._wlock:
            self._closed = True
            self.sock.close()


def _send_all(sock: socket.socket, views: list[memoryview], flags: int) -> None:
    views = [v.cast("B") for v in views if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_MAX], (), flags)
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
