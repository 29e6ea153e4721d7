"""The control channel of the socket transports: frames over one stream socket (TCP or Unix),
a credit-counting StreamSender and a StreamReceiver whose pump thread fills the ring.

tcp.py and shm.py only say how a payload reaches the slot (rdma.py can do the same).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.base import (
    Delivery,
    Inbox,
    Layout,
    Receiver,
    Sender,
    Tensors,
    lay_out,
    open_delivery,
    slot_view,
)
from nicoffload.transport.frame import (
    HEADER_SIZE,
    MAX_META,
    Header,
    Hello,
    Kind,
    Welcome,
    decode_meta,
    encode,
    error_frame,
    error_from_frame,
    head_size,
)

STAGING = 2 * (HEADER_SIZE + MAX_META)  # read buffer: a whole frame head always fits
DIRECT = 32 * 1024  # payload remainders this big are read straight into the slot
IO_TIMEOUT = 30.0  # a peer silent this long in the middle of a frame is gone
HANDSHAKE_TIMEOUT = 10.0  # a connection that says no HELLO by then is dropped
IOV_MAX = 1024
log = logging.getLogger(__name__)


class Channel:
    """A connected stream socket carrying frames. One reader; writers serialized by a lock."""

    def __init__(self, sock: socket.socket, peer: str, io_timeout: float = IO_TIMEOUT) -> None:
        self.sock, self.peer = sock, peer
        self._buf = memoryview(bytearray(STAGING))
        self._start = self._end = 0
        self._wlock = threading.Lock()
        self._closed = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        # Kernel-side timeouts: no poll() per call, and a hung peer cannot block us for ever.
        tv = struct.pack("ll", int(io_timeout), int(io_timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def send(self, head: bytes, payload: Sequence[np.ndarray] = (), flags: int = 0) -> None:
        """Write a frame head and its payload buffers (gathered, no copy)."""
        views = [memoryview(head), *(memoryview(p) for p in payload)]
        with self._wlock:
            if self._closed:
                raise TransportError(f"{self.peer}: the connection is closed")
            try:
                _send_all(self.sock, views, flags | socket.MSG_NOSIGNAL)
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
        if self._end > self._start:
            return True
        return bool(self._poll.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def read_head(self, max_payload: int) -> tuple[Header, bytes] | None:
        """The next frame's header and metadata blob; None on a clean EOF between frames."""
        if not self._fill(HEADER_SIZE, boundary=True):
            return None
        size = head_size(self._buf[self._start : self._start + HEADER_SIZE])
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
            k = self._recv(self._buf[self._end :], mid_frame=not at_boundary)
            if k == 0 and at_boundary:
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


class StreamSender(Sender):
    """A Sender over a Channel; subclasses say how a batch reaches the slot (`_write`)."""

    transport = "stream"

    def __init__(
        self, address: str, sock: socket.socket, *, timeout: float, pipeline_id: int, stage_id: int
    ) -> None:
        self.address, self._ids = address, (pipeline_id, stage_id)
        self._ch = Channel(sock, f"receiver at {address}")
        self._lock = threading.Lock()
        self._broken: TransportError | None = None
        self._closed = False
        try:
            self._ch.send(encode(Header(Kind.HELLO), Hello(self.transport)))
            if not self._ch.readable(timeout):
                raise TransportError(f"{self._ch.peer}: no WELCOME within {timeout} s")
            header, meta = self._read(0)
            if header.kind is not Kind.WELCOME:
                raise FrameError(f"malformed frame: kind: {header.kind.name}, expected WELCOME")
            welcome = decode_meta(meta, Welcome)
            self.slots, self.slot_bytes = welcome.slots, welcome.slot_bytes
            self._attach(welcome)
            self._ch.send(encode(Header(Kind.ACK)))
        except BaseException:
            self._ch.close()
            self._detach()
            raise
        self._free = list(range(self.slots))[::-1]  # a stack: reuse the slot freed last (warm)
        self._out: set[int] = set()

    def _attach(self, welcome: Welcome) -> None:
        """Map the receiver's ring, where the payload is written out of band (shm)."""

    def _detach(self) -> None:
        """Undo `_attach`; idempotent."""

    def _write(self, slot: int, layout: Layout, request_id: int) -> None:
        raise NotImplementedError

    def send(
        self,
        tensors: Tensors,
        *,
        request_id: int = 0,
        batch_size: int | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> int:
        layout = lay_out(tensors, self.slot_bytes, batch_size=batch_size, meta=meta)
        with self._lock:
            self._check()
            if not self._wait(lambda: self._free, timeout):
                raise TransportError(f"{self._ch.peer}: no free slot within {timeout} s")
            slot = self._free.pop()
            self._out.add(slot)
            self._guard(self._write, slot, layout, request_id)
            return slot

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            self._check()
            if not self._wait(lambda: not self._out, timeout):
                raise TransportError(f"{self._ch.peer}: {len(self._out)} batches still held")

    def _wait(self, done: Any, timeout: float | None) -> bool:
        """Take in credits until done() or the timeout; True if done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._guard(self._take_credits, 0.0)
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._guard(self._take_credits, left)
        return True

    def _take_credits(self, timeout: float | None) -> None:
        while self._ch.readable(timeout):
            header, _ = self._read(0)
            if header.kind is Kind.CREDIT and header.slot in self._out:
                self._out.remove(header.slot)
                self._free.append(header.slot)
            elif header.kind is Kind.CREDIT:
                raise FrameError(f"malformed frame: slot: credit for slot {header.slot}, not out")
            elif header.kind is not Kind.HEARTBEAT:
                raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")
            timeout = 0.0

    def _read(self, max_payload: int) -> tuple[Header, bytes]:
        got = self._ch.read_head(max_payload)
        if got is None:
            raise TransportError(f"{self._ch.peer} closed the connection")
        if got[0].kind is Kind.ERROR:
            raise error_from_frame(got[1], self._ch.peer)
        if got[0].kind is Kind.SHUTDOWN:
            raise TransportError(f"{self._ch.peer} closed")
        return got

    def _guard(self, fn: Any, *args: Any) -> None:
        """Run fn; any failure but a timeout leaves the stream unusable: close it, for good."""
        try:
            fn(*args)
        except TransportError as exc:
            self._broken = exc
            self._ch.close()
            self._detach()
            raise

    def _check(self) -> None:
        if self._closed:
            raise TransportError(f"sender to {self.address} is closed")
        if self._broken is not None:
            raise TransportError(f"sender to {self.address} failed earlier: {self._broken}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            self._ch.post(encode(Header(Kind.SHUTDOWN)), socket.MSG_DONTWAIT)
        self._ch.shutdown()  # wakes a send() blocked on credits in another thread...
        with self._lock:  # ...which must be out before the fd is closed (and maybe reused)
            self._ch.close()
            self._detach()


class StreamReceiver(Receiver):
    """A Receiver whose pump thread accepts one sender, then reads frames and fills the ring."""

    transport = "stream"

    def __init__(
        self, address: str, listener: socket.socket, slots: int, slot_bytes: int, ring: np.ndarray
    ) -> None:
        self.address, self.slots, self.slot_bytes = address, slots, slot_bytes
        self._listener, self._ring = listener, ring
        self._inbox = Inbox(f"receiver at {address}")
        self._wake_r, self._wake_w = socket.socketpair()
        self._ch: Channel | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._credits: dict[int, bytes] = {}
        self._thread = threading.Thread(target=self._run, name=f"recv {address}", daemon=True)
        self._thread.start()

    # hooks for the data path
    def _welcome(self) -> Welcome:
        return Welcome(self.slots, self.slot_bytes)

    def _accepted(self, sock: socket.socket) -> None:
        """A sender connected: tune its socket, or refuse it (TransportError)."""

    def _fill(self, ch: Channel, header: Header, slot: np.ndarray) -> None:
        raise NotImplementedError

    def _on_ack(self) -> None:
        """The sender is set up (shm: it has mapped the ring, so the name can go)."""

    def _free_ring(self) -> None:
        """Give the ring back (shm: unlink and unmap); idempotent."""

    def _run(self) -> None:
        ch = None
        try:
            ch = self._accept()
            if ch is not None:
                self._pump(ch)
        except Exception as exc:
            if not isinstance(exc, TransportError):  # a bug: still, recv must not hang
                err = TransportError(f"receiver at {self.address} failed: {exc!r}")
                err.__cause__, exc = exc, err
            if not self._closed:
                if ch is not None and isinstance(exc, FrameError):  # say why before hanging up
                    ch.post(error_frame(exc), socket.MSG_DONTWAIT)
                self._inbox.end(exc)
            if ch is not None:
                ch.shutdown()

    def _accept(self) -> Channel | None:
        poll = select.poll()
        poll.register(self._listener, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        while True:
            poll.poll()
            if self._closed:
                return None
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                raise TransportError(f"receiver at {self.address}: accept failed: {exc}") from exc
            ch = Channel(sock, f"sender to {self.address}")
            with self._lock:
                self._ch = ch  # so that close() can wake the handshake below
            try:
                if self._closed:
                    raise TransportError("closing")
                self._accepted(sock)
                if not ch.readable(HANDSHAKE_TIMEOUT):
                    raise TransportError(f"no HELLO within {HANDSHAKE_TIMEOUT} s")
                got = ch.read_head(0)
                if got is None or got[0].kind is not Kind.HELLO:
                    raise FrameError(f"expected HELLO, got {got and got[0].kind.name}")
                hello = decode_meta(got[1], Hello)
                if hello.transport != self.transport:
                    raise FrameError(f"a {hello.transport} sender, this is a {self.transport} ring")
                ch.send(encode(Header(Kind.WELCOME), self._welcome()))
            except TransportError as exc:
                with self._lock:
                    self._ch = None
                ch.close()
                if self._closed:
                    return None
                log.warning("receiver at %s: refused a connection: %s", self.address, exc)
                continue
            self._listener.close()  # one sender per receiver: later connects are refused
            return ch

    def _pump(self, ch: Channel) -> None:
        while True:
            got = ch.read_head(self.slot_bytes)
            if got is None:
                raise TransportError(f"{ch.peer}: disconnected without SHUTDOWN")
            header, meta = got
            if header.kind is Kind.DATA:
                delivery = open_delivery(self._ring, self.slot_bytes, header, meta)
                self._inbox.claim(header)
                slot = slot_view(self._ring, header.slot, self.slot_bytes)
                self._fill(ch, header, slot[: header.payload_len])
                self._inbox.put(delivery)
            elif header.payload_len:
                raise FrameError(f"malformed frame: payload_len: {header.kind.name} with payload")
            elif header.kind is Kind.ACK:
                self._on_ack()
            elif header.kind is Kind.SHUTDOWN:
                self._inbox.end()
                return
            elif header.kind is Kind.ERROR:
                raise error_from_frame(meta, ch.peer)
            elif header.kind is not Kind.HEARTBEAT:
                raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")

    def recv(self, timeout: float | None = None) -> Delivery | None:
        if self._closed:
            raise TransportError(f"receiver at {self.address} is closed")
        return self._inbox.get(timeout)

    def release(self, delivery: Delivery) -> None:
        ch = self._ch
        if not self._inbox.take_back(delivery) or ch is None:
            return
        credit = self._credits.get(delivery.slot)
        if credit is None:
            credit = self._credits[delivery.slot] = encode(Header(Kind.CREDIT, slot=delivery.slot))
        ch.post(credit)  # if the sender is gone, recv reports how

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ch = self._ch
        try:
            self._wake_w.send(b"x")
            if ch is not None:
                ch.post(encode(Header(Kind.SHUTDOWN)), socket.MSG_DONTWAIT)
                ch.shutdown()
            self._thread.join()
        finally:
            for resource in (ch, self._listener, self._wake_r, self._wake_w):
                if resource is not None:
                    resource.close()
            self._inbox.close(TransportError(f"receiver at {self.address} is closed"))
            self._free_ring()
