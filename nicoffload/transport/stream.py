"""Sender and Receiver over a Channel (the socket transports): HELLO/WELCOME/ACK handshake,
credits, and a recv that reads frames in the caller's thread. Subclasses move the payload.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.base import MAX_SLOTS, Receiver, Sender
from nicoffload.transport.channel import IO_TIMEOUT, Channel
from nicoffload.transport.frame import (
    MAX_PAYLOAD,
    OUT_OF_BAND,
    Header,
    Kind,
    Welcome,
    encode,
    error_frame,
    error_from_frame,
)
from nicoffload.transport.handshake import check_key, greet_sender, open_sender, welcome
from nicoffload.transport.handshake import expect as _expect
from nicoffload.transport.slots import (
    Delivery,
    Inbox,
    Layout,
    Packer,
    Tensors,
    Unpacker,
    slot_view,
)

HANDSHAKE_TIMEOUT = 10.0  # a connection that completes no handshake by then is dropped
CREDIT_BATCH = 4  # credits go back in groups of slots // CREDIT_BATCH (at least 1)
log = logging.getLogger(__name__)
_SHUTDOWN = encode(Header(Kind.SHUTDOWN))
_EOF = object()  # the sender said SHUTDOWN: recv returns None from then on
_DONTWAIT = int(socket.MSG_DONTWAIT)  # goodbyes are best effort: never block on them


class SlotSender(Sender):
    """What a sender over a control Channel shares, whatever carries the payload (stream, rdma):
    HELLO and WELCOME (`_open`), the free and outstanding slots under one lock, waiting for
    credits (`_take_credits`, the subclass's own), `flush`, and a failure being final (`_guard`:
    the channel closes and `_detach` frees what else the transport holds)."""

    transport = "stream"

    def _open(
        self, address: str, sock: socket.socket, timeout: float, key: bytes | None
    ) -> Welcome:
        self.address = address
        # The handshake within `timeout`, mid-frame too (a peer that sends a few bytes of
        # something else does not hold it for IO_TIMEOUT); the connection then under IO_TIMEOUT.
        self._ch = Channel(sock, f"receiver at {address}", io_timeout=timeout)
        self._lock = threading.Lock()
        self._broken: TransportError | None = None
        self._closed = False
        welcome = open_sender(self._ch, self.transport, check_key(key), timeout)
        self._ch.set_io_timeout(IO_TIMEOUT)
        if not (1 <= welcome.slots <= MAX_SLOTS and 1 <= welcome.slot_bytes <= MAX_PAYLOAD):
            raise FrameError(
                f"malformed frame: meta: a ring of {welcome.slots} x {welcome.slot_bytes} bytes"
            )
        self.slots, self.slot_bytes = welcome.slots, welcome.slot_bytes
        self._free = list(range(self.slots))[::-1]  # a stack: reuse the slot freed last (warm)
        self._out: set[int] = set()
        return welcome

    def _detach(self) -> None:
        """Free what the transport holds besides the channel (a mapping, verbs); idempotent."""

    def _admit(self, layout: Layout) -> None:
        """Refuse, before it takes a slot, a batch this transport cannot carry."""

    def _write(self, slot: int, arrays: list[np.ndarray], layout: Layout, request_id: int) -> None:
        """Put the batch into the receiver's slot and announce it."""
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
        arrays, layout = self._pack(tensors, batch_size, meta)
        self._admit(layout)
        with self._lock:
            self._check()
            # Credits (or an ERROR, a SHUTDOWN) waiting on the socket, or no slot free.
            if (self._ch.readable(0) or not self._free) and not self._wait(self._has_free, timeout):
                raise TransportError(f"{self._ch.peer}: no free slot within {timeout} s")
            slot = self._free.pop()
            self._out.add(slot)
            self._guard(self._write, slot, arrays, layout, request_id)
            return slot

    def _take_credits(self, timeout: float | None) -> None:
        raise NotImplementedError

    def _has_free(self) -> bool:
        return bool(self._free)

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            self._check()
            if not self._wait(lambda: not self._out, timeout):
                raise TransportError(f"{self._ch.peer}: {len(self._out)} batches still held")

    def _wait(self, done: Callable[[], object], timeout: float | None) -> bool:
        """Take in credits until done() or the timeout; True if done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._guard(self._take_credits, 0.0)
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._guard(self._take_credits, left)
        return True

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn; a failure leaves the sender unusable: close it, for good."""
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


class StreamSender(SlotSender):
    """A Sender over a Channel; a subclass says how a batch reaches the slot (`_write`)."""

    out_of_band = False  # the payload goes into the slot by another path than the socket

    def __init__(
        self,
        address: str,
        sock: socket.socket,
        *,
        timeout: float,
        pipeline_id: int,
        stage_id: int,
        key: bytes | None = None,
    ) -> None:
        try:
            self._attach(self._open(address, sock, timeout, key))
            self._ch.send(encode(Header(Kind.ACK)))
        except BaseException:
            if hasattr(self, "_ch"):
                self._ch.close()
            self._detach()
            raise
        flags = OUT_OF_BAND if self.out_of_band else 0
        self._pack = Packer(self.slot_bytes, flags, pipeline_id, stage_id)

    def _attach(self, welcome: Welcome) -> None:
        """Map the receiver's ring, for a payload written out of band (shm; `_detach` undoes)."""

    def _take_credits(self, timeout: float | None) -> None:
        while self._ch.readable(timeout):
            got = self._ch.read_head(0)
            if got is None:
                raise TransportError(f"{self._ch.peer} closed the connection")
            header, meta = got
            if header.kind is Kind.CREDIT and header.slot in self._out:
                self._out.remove(header.slot)
                self._free.append(header.slot)
            elif header.kind is Kind.ERROR:
                raise error_from_frame(meta, self._ch.peer)
            elif header.kind is Kind.SHUTDOWN:
                raise TransportError(f"{self._ch.peer} closed")
            elif header.kind is Kind.CREDIT:
                raise FrameError(f"malformed frame: slot: credit for slot {header.slot}, not out")
            elif header.kind is not Kind.HEARTBEAT:
                raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")
            timeout = 0.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            self._ch.post(_SHUTDOWN, _DONTWAIT)
        self._ch.shutdown()  # wakes a send() blocked on credits in another thread...
        with self._lock:  # ...which must be out before the fd is closed (and maybe reused)
            self._ch.close()
            self._detach()


class OneSenderReceiver(Receiver):
    """What every receiver of one sender over a control Channel shares: a helper thread accepts
    the sender and shakes hands with it (`_shake`), recv first waits for that (`_sender`), a
    failure while receiving is final (`_final_on_error`), and close wakes whoever waits, then
    frees everything (`_free`, a subclass's own). A subclass sets its own state, then calls
    `__init__` here last: the helper thread starts at its end."""

    transport = "stream"

    def __init__(
        self,
        address: str,
        listener: socket.socket,
        slots: int,
        slot_bytes: int,
        key: bytes | None = None,
    ) -> None:
        self.address, self.slots, self.slot_bytes = address, slots, slot_bytes
        self._key = check_key(key)  # only a sender that proves it may attach
        self._nonces: tuple[bytes, bytes] | None = None  # of the handshake in progress
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._ch: Channel | None = None
        self._lock = threading.Lock()  # guards _ch and _closed against close()
        self._recv_lock = threading.Lock()  # one reader of the channel at a time
        self._ready = threading.Event()  # set when a sender is connected, or never will be
        self._final: object = None  # _EOF or the error, for good
        self._closed = False
        self._helper = threading.Thread(target=self._serve, name=f"recv {address}", daemon=True)
        self._helper.start()

    # hooks
    def _accepted(self, sock: socket.socket) -> None:
        """A sender connected: tune its socket, or refuse it (TransportError)."""

    def _shake(self, ch: Channel) -> None:
        """The handshake after HELLO (checked already) and, with a key, the sender's proof: it
        sends the WELCOME (`_welcome_sender`); TransportError refuses the sender."""
        raise NotImplementedError

    def _welcome_sender(self, ch: Channel, meta: Welcome) -> None:
        """Send WELCOME: with the proof and the channel secured from then on, with a key."""
        welcome(ch, meta, self._key, self._nonces)

    def _serve_on(self, ch: Channel) -> None:
        """The helper thread's work once a sender is connected (tcp: read ahead); none here."""

    def _woken(self) -> None:
        """In close, before taking the recv lock: wake a recv that waits elsewhere than ch."""

    def _free(self) -> None:
        """In close, with no recv running: free this receiver's own resources."""

    def _serve(self) -> None:
        poll = select.poll()
        poll.register(self._listener, select.POLLIN)
        poll.register(self._wake_r, select.POLLIN)
        try:
            while not self._closed:
                poll.poll()
                if not self._closed and self._handshake():
                    self._listener.close()  # one sender per receiver: later connects are refused
                    break
        except OSError as exc:
            self._final = TransportError(f"receiver at {self.address}: accept failed: {exc}")
        finally:
            self._ready.set()
        if self._ch is not None:
            self._serve_on(self._ch)

    def _handshake(self) -> bool:
        sock, _ = self._listener.accept()
        ch = Channel(sock, f"sender to {self.address}")
        with self._lock:
            self._ch = ch  # so that close() can wake the handshake below
        try:
            self._accepted(sock)
            self._nonces = greet_sender(
                ch, self.transport, self._key, HANDSHAKE_TIMEOUT, self._listener
            )
            self._shake(ch)
            return True
        except TransportError as exc:
            with self._lock:
                self._ch = None
            if not self._closed:
                log.warning("receiver at %s: refused a connection: %s", self.address, exc)
                ch.post(error_frame(exc), _DONTWAIT)  # the sender learns why
            ch.close()
            return False

    def _sender(self, timeout: float | None) -> Channel:
        """The connected sender's channel, waited for up to `timeout` s (under _recv_lock)."""
        if self._closed:
            raise TransportError(f"receiver at {self.address} is closed")
        if not self._ready.wait(timeout):
            raise TransportError(f"receiver at {self.address}: no sender within {timeout} s")
        if self._closed:  # close() woke this wait: no sender came
            raise TransportError(f"receiver at {self.address} is closed")
        if self._ch is None:  # accepting failed
            raise self._final  # type: ignore[misc]
        return self._ch

    @contextlib.contextmanager
    def _final_on_error(self, ch: Channel) -> Iterator[None]:
        """Around receiving: a failure is final. The sender is told why (ERROR) and the
        connection is shut; after close() the error says closed."""
        try:
            yield
        except TransportError as exc:
            if self._closed:
                raise TransportError(f"receiver at {self.address} is closed") from exc
            if isinstance(exc, FrameError):
                ch.post(error_frame(exc), _DONTWAIT)
            ch.shutdown()
            self._final = exc
            raise

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ch = self._ch
        self._wake_w.send(b"x")
        if ch is not None:
            ch.post(_SHUTDOWN, _DONTWAIT)
            ch.shutdown()  # wakes a recv or a handshake blocked on it
        self._helper.join()
        self._woken()
        with self._recv_lock:
            for resource in (ch, self._listener, self._wake_r, self._wake_w):
                if resource is not None:
                    resource.close()
            self._free()


class StreamReceiver(OneSenderReceiver):
    """A receiver over the socket itself: recv reads frames in the caller's thread (no hand-off
    between threads per batch), or, with `read_ahead`, the helper thread goes on reading DATA
    into the ring and queues deliveries."""

    # The payload is on the socket (tcp): a sender holding credits must not wait on recv().
    read_ahead = False

    def __init__(
        self,
        address: str,
        listener: socket.socket,
        slots: int,
        slot_bytes: int,
        ring: np.ndarray,
        key: bytes | None = None,
    ) -> None:
        self._unpack = Unpacker(ring, slot_bytes)
        self._inbox = Inbox(f"receiver at {address}")  # the queue is used with read_ahead only
        self._credits: dict[int, bytes] = {}  # the CREDIT frame of each slot, packed once
        self._pending: list[bytes] = []  # credits held back, to send in one write
        self._credit_batch = max(1, slots // CREDIT_BATCH)
        self._credit_lock = threading.Lock()
        self._recv_waits = False
        super().__init__(address, listener, slots, slot_bytes, key)

    # hooks for the data path
    def _welcome(self) -> Welcome:
        return Welcome(self.slots, self.slot_bytes)

    def _fill(self, ch: Channel, header: Header, slot: np.ndarray) -> None:
        """Get the payload of a DATA frame into `slot` (its first payload_len bytes)."""
        raise NotImplementedError

    def _on_ack(self) -> None:
        """The sender is set up (shm: it has mapped the ring, so the name can go)."""

    def _free_ring(self) -> None:
        """Give the ring back (shm: unlink and unmap); idempotent."""

    def _shake(self, ch: Channel) -> None:
        self._welcome_sender(ch, self._welcome())
        _expect(ch, Kind.ACK, HANDSHAKE_TIMEOUT)
        self._on_ack()

    def _serve_on(self, ch: Channel) -> None:
        if self.read_ahead:
            self._read_ahead(ch)

    def _read_ahead(self, ch: Channel) -> None:
        try:
            while self._final is None:
                delivery = self._next(ch)
                if delivery is not None:
                    self._inbox.put(delivery)
            self._inbox.end()
        except TransportError as exc:
            self._inbox.end(exc)

    def recv(self, timeout: float | None = None) -> Delivery | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._recv_lock:
            self._sender(timeout)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.read_ahead:
                if not self._inbox.empty():
                    return self._inbox.get(left, timeout)
                with self._waiting():
                    return self._inbox.get(left, timeout)
            while self._final is None:
                ch = self._ch
                assert ch is not None
                if not ch.readable(0):
                    with self._waiting():
                        if not ch.readable(left):
                            raise TransportError(
                                f"receiver at {self.address}: no batch within {timeout} s"
                            )
                delivery = self._next(ch)
                if delivery is not None:
                    return self._inbox.hand_out(delivery)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._final is _EOF:
                return None
            raise self._final  # type: ignore[misc]

    def _next(self, ch: Channel) -> Delivery | None:
        """Read one frame: the Delivery it announces, or None for a control frame. A failure
        is final: the sender is told why (ERROR) and the connection is shut."""
        with self._final_on_error(ch):
            return self._read(ch)

    def _read(self, ch: Channel) -> Delivery | None:
        got = ch.read_head(self.slot_bytes)
        if got is None:
            raise TransportError(f"{ch.peer}: disconnected without SHUTDOWN")
        header, meta = got
        if header.kind is Kind.DATA:
            delivery = self._unpack(header, meta)
            self._inbox.claim(header)
            slot = slot_view(self._unpack.ring, header.slot, self.slot_bytes)
            self._fill(ch, header, slot[: header.payload_len])
            return delivery
        if header.payload_len:
            raise FrameError(f"malformed frame: payload_len: {header.kind.name} with payload")
        if header.kind is Kind.SHUTDOWN:
            self._final = _EOF
        elif header.kind is Kind.ERROR:
            raise error_from_frame(meta, ch.peer)
        elif header.kind is not Kind.HEARTBEAT:
            raise FrameError(f"malformed frame: kind: unexpected {header.kind.name}")
        return None

    def release(self, delivery: Delivery) -> None:
        """Credits go back in groups of slots // CREDIT_BATCH (fewer syscalls and wakeups on
        both sides), and all at once as soon as a recv waits: a sender never waits for a slot
        released while this side waits too."""
        if not self._inbox.take_back(delivery) or self._ch is None:
            return
        credit = self._credits.get(delivery.slot)
        if credit is None:
            credit = self._credits[delivery.slot] = encode(Header(Kind.CREDIT, slot=delivery.slot))
        with self._credit_lock:
            self._pending.append(credit)
            if len(self._pending) < self._credit_batch and not self._recv_waits:
                return
        self._flush_credits()

    def _flush_credits(self) -> None:
        with self._credit_lock:
            frames, self._pending = self._pending, []
        if frames and self._ch is not None:
            self._ch.post(frames)  # one write; if the sender is gone, recv reports how

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Around a recv that is about to block: first return every credit held back."""
        self._recv_waits = True  # before the flush: a release racing with it sends its own
        try:
            self._flush_credits()
            yield
        finally:
            self._recv_waits = False

    def _woken(self) -> None:
        # Wake a recv waiting on the queue (read_ahead) before its lock is taken.
        self._inbox.end(TransportError(f"receiver at {self.address} is closed"))

    def _free(self) -> None:
        self._inbox.close()
        self._free_ring()
