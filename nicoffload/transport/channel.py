"""A framed stream socket (TCP or Unix): buffered reads of frame heads, payloads read straight
into the caller's memory, gathered writes; the control channel of the socket transports. After
`secure`, every frame in both directions carries a MAC trailer (`integrity`), checked here.
"""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.frame import (
    FIELD_OFFSETS,
    HEADER_SIZE,
    MAX_META,
    OUT_OF_BAND,
    Header,
    head_size,
)
from nicoffload.transport.integrity import TAG_BYTES, FrameMac, verify

STAGING = 2 * (HEADER_SIZE + MAX_META)  # read buffer: a whole frame head and its tag always fit
DIRECT = 32 * 1024  # payload remainders this big are read straight into the destination
READ_SIZE = 16 * 1024  # a read for a frame head asks for this much: many small frames at once
IO_TIMEOUT = 30.0  # a peer silent this long in the middle of a frame is gone
IOV_MAX = 1024
MAC_PIECE = 256 * 1024  # a MAC'd payload is hashed and sent in pieces this big (cache-warm)
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
        self.io_timeout = io_timeout
        self._transcript: Any = None  # sha256 of the frames so far, while `record`ing
        self._tx: FrameMac | None = None  # set by `secure`: frames sent carry a tag...
        self._rx: FrameMac | None = None  # ...and frames read must carry a valid one
        self._mac: Any = None  # the MAC of the frame whose payload is being read
        self._left = 0  # payload bytes of that frame still to read (its tag follows them)
        self.set_io_timeout(io_timeout)

    def set_io_timeout(self, seconds: float) -> None:
        """How long a peer may stay silent mid-frame (or not read what is sent): a handshake
        runs under its own deadline, the connection then under IO_TIMEOUT."""
        # Kernel-side timeouts: no poll() per call, and a hung peer cannot block us for ever.
        tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.io_timeout = seconds

    # --- integrity ---------------------------------------------------------------------------

    def record(self) -> None:
        """Hash every frame sent or read from now on: the handshake's transcript (`transcript`),
        which the session's keys are then derived from, so that both sides saw the same one."""
        self._transcript = hashlib.sha256()

    def transcript(self) -> bytes:
        return self._transcript.digest()

    def secure(self, send_key: bytes, recv_key: bytes) -> None:
        """From now on every frame sent carries a tag under `send_key`, and every frame read
        must carry one under `recv_key` (each with its own count of frames): a frame that does
        not is a FrameError (field `mac`) and never reaches the caller."""
        with self._wlock:
            self._tx, self._rx, self._transcript = FrameMac(send_key), FrameMac(recv_key), None

    @property
    def secured(self) -> bool:
        return self._rx is not None

    # --- writing -------------------------------------------------------------------------------

    def send(
        self, head: bytes | bytearray, payload: Sequence[np.ndarray] = (), flags: int = 0
    ) -> None:
        """Write one frame: its head and its payload buffers (gathered, no copy)."""
        self.send_frames([head], payload, flags)

    def send_frames(
        self, heads: Sequence[bytes | bytearray], payload: Sequence[Any] = (), flags: int = 0
    ) -> None:
        """Write frames in one go: heads of frames with no payload, the last one followed by
        `payload` (the bytes of it that go on the socket). Once the channel is secured each
        frame is followed by its tag, over what of it went on the socket."""
        flags |= _NOSIGNAL
        with self._wlock:
            if self._closed:
                raise TransportError(f"{self.peer}: the connection is closed")
            parts: list[Any] = []
            mac = None
            if self._tx is not None:
                for head in heads[:-1]:
                    parts += (head, self._tx.tag([head]))
                if payload:  # hashed piece by piece as it goes (`_send_all`), then its tag
                    mac = self._tx.start()
                    parts += (heads[-1], *payload)
                else:
                    parts += (heads[-1], self._tx.tag([heads[-1]]))
            else:
                if self._transcript is not None:
                    for head in heads:
                        self._transcript.update(head)
                parts += (*heads, *payload)
            try:
                if len(parts) > 1:
                    _send_all(self.sock, list(map(memoryview, parts)), flags, mac)
                else:
                    self.sock.sendall(parts[0], flags)
            except BlockingIOError as exc:
                raise TransportError(
                    f"{self.peer}: stopped reading for {self.io_timeout} s"
                ) from exc
            except OSError as exc:
                raise TransportError(f"{self.peer}: send failed: {exc}") from exc

    def post(self, head: bytes | Sequence[bytes], flags: int = 0) -> bool:
        """Best-effort send of a control frame (or of several: a list of heads): False (not an
        error) if the peer is gone."""
        try:
            self.send_frames([head] if isinstance(head, (bytes, bytearray)) else head, flags=flags)
        except TransportError:
            return False
        return True

    def readable(self, timeout: float | None) -> bool:
        """Whether a frame (or EOF) is there to read, waiting up to `timeout` s (None: for ever)."""
        if self._end > self._start:
            return True
        ms = None if timeout is None else max(0, int(timeout * 1000))
        return bool(self._poll.poll(ms))

    # --- reading -------------------------------------------------------------------------------

    def read_head(self, max_payload: int) -> tuple[Header, bytes] | None:
        """The next frame's header and metadata blob; None on a clean EOF between frames. On a
        secured channel a frame with no payload on the socket is checked before it is returned;
        one with a payload, when `read_into` has read the payload (its tag follows it)."""
        if self._left:
            raise FrameError("malformed frame: payload_len: the last frame's payload was not read")
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
            blob = b""
        else:
            size = head_size(self._buf[at : at + HEADER_SIZE])
            self._fill(size)
            raw = bytes(self._buf[self._start : self._start + size])
            header = Header.unpack(raw, max_payload=max_payload)
            self._start += size
            blob = raw[HEADER_SIZE:]
        if self._rx is not None:
            self._mac = self._rx.start()
            self._mac.update(raw)
            self._left = header.payload_len if not header.flags & OUT_OF_BAND else 0
            if not self._left:
                self._check_tag()
        elif self._transcript is not None:
            self._transcript.update(raw)
        return header, blob

    def read_into(self, dst: memoryview) -> None:
        """Read exactly len(dst) payload bytes into dst: large runs straight from the socket.
        On a secured channel the MAC follows the bytes as they come, and the frame's tag is
        checked when the last of its payload has been read (FrameError if it fails)."""
        n = len(dst)
        if self._rx is not None and n > self._left:
            raise FrameError(f"malformed frame: payload_len: {n} bytes read of {self._left} left")
        got = min(n, self._end - self._start)
        dst[:got] = self._buf[self._start : self._start + got]
        self._start += got
        hashed = 0
        while got < n:
            if n - got >= DIRECT:
                got += self._recv(dst[got:], mid_frame=True)
            else:
                self._fill(1)
                k = min(n - got, self._end - self._start)
                dst[got : got + k] = self._buf[self._start : self._start + k]
                self._start += k
                got += k
            if self._mac is not None and got - hashed >= DIRECT:  # while the bytes are in cache
                self._mac.update(dst[hashed:got])
                hashed = got
        if self._rx is not None and n:
            self._mac.update(dst[hashed:n])
            self._left -= n
            if not self._left:
                self._check_tag()

    def _check_tag(self) -> None:
        self._fill(TAG_BYTES)
        tag = self._buf[self._start : self._start + TAG_BYTES]
        self._start += TAG_BYTES
        mac, self._mac = self._mac, None
        verify(mac, tag)

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
                raise TransportError(
                    f"{self.peer}: silent for {self.io_timeout} s mid-frame"
                ) from exc
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


def _send_all(sock: socket.socket, views: list[memoryview], flags: int, mac: Any = None) -> None:
    """sendmsg until all is sent. With `mac`, pieces (at most MAC_PIECE bytes each) are hashed
    at most MAC_PIECE bytes ahead of what went, while they are in cache, and the tag goes last:
    a frame of up to MAC_PIECE bytes goes whole, tag included, in one sendmsg (a receiver never
    waits mid-frame on a sender that was descheduled between pieces)."""
    views = [v.cast("B") for v in views if v.nbytes]
    hashed = len(views)  # views before this one are in the MAC (all of them: no MAC)
    if mac is not None:
        views = [v[at : at + MAC_PIECE] for v in views for at in range(0, len(v), MAC_PIECE)]
        views.append(memoryview(b""))  # the tag's place
        hashed = 0
    i = 0
    while i < len(views):
        ahead = sum(len(v) for v in views[i:hashed])
        while hashed < len(views) and (hashed <= i or ahead + len(views[hashed]) <= MAC_PIECE):
            if hashed < len(views) - 1:
                mac.update(views[hashed])
                ahead += len(views[hashed])
            else:
                views[hashed] = memoryview(mac.digest())
            hashed += 1
        sent = sock.sendmsg(views[i : min(i + IOV_MAX, hashed)], (), flags)
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
