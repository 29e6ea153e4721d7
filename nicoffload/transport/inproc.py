"""In-process transport (`inproc://name`): the test double. Same slots, credits, backpressure,
frames and errors as the real transports; the ring is a numpy array and nothing leaves the process.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from nicoffload.errors import TransportError
from nicoffload.transport.base import Receiver, Sender
from nicoffload.transport.frame import HEADER_SIZE, OUT_OF_BAND, Header
from nicoffload.transport.handshake import check_key
from nicoffload.transport.slots import Delivery, Inbox, Packer, Tensors, Unpacker, slot_view, stride

# The in-process namespace of listening receivers, as the kernel has one for sockets.
_LISTENING: dict[str, InprocReceiver] = {}
_NAMESPACE = threading.Lock()


class InprocReceiver(Receiver):
    def __init__(self, address: str, slots: int, slot_bytes: int) -> None:
        self.address, self.slots, self.slot_bytes = address, slots, slot_bytes
        self.ring = np.empty(slots * stride(slot_bytes), np.uint8)
        self.unpack = Unpacker(self.ring, slot_bytes)
        self.inbox = Inbox(f"receiver at {address}")
        self.cond = threading.Condition()
        self.free = list(range(slots))[::-1]  # the sender's credits, as a stack
        self.closed = False
        self.key: bytes | None = None  # a sender must present it (`connect`)

    def recv(self, timeout: float | None = None) -> Delivery | None:
        if self.closed:
            raise TransportError(f"receiver at {self.address} is closed")
        return self.inbox.get(timeout)

    def release(self, delivery: Delivery) -> None:
        if not self.inbox.take_back(delivery):
            return
        with self.cond:
            self.free.append(delivery.slot)
            self.cond.notify_all()

    def close(self) -> None:
        with _NAMESPACE:
            if _LISTENING.get(self.address) is self:
                del _LISTENING[self.address]
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self.inbox.close()


class InprocSender(Sender):
    def __init__(self, receiver: InprocReceiver, pipeline_id: int, stage_id: int) -> None:
        self.address, self.slots, self.slot_bytes = (
            receiver.address,
            receiver.slots,
            receiver.slot_bytes,
        )
        self._rx = receiver
        self._pack = Packer(self.slot_bytes, OUT_OF_BAND, pipeline_id, stage_id)
        self._closed = False

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
        rx = self._rx
        with rx.cond:
            self._check()
            if not rx.cond.wait_for(lambda: rx.free or rx.closed, timeout):
                raise TransportError(f"receiver at {self.address}: no free slot within {timeout} s")
            self._check()
            slot = rx.free.pop()
        layout.copy_into(slot_view(rx.ring, slot, self.slot_bytes), arrays)
        # Through the wire format, so the double checks what the real transports check.
        head = layout.announce(slot, request_id)
        header = Header.unpack(head, max_payload=self.slot_bytes)
        delivery = rx.unpack(header, bytes(head[HEADER_SIZE:]))
        rx.inbox.claim(header)
        rx.inbox.put(delivery)
        return slot

    def flush(self, timeout: float | None = None) -> None:
        rx = self._rx
        with rx.cond:
            self._check()
            if not rx.cond.wait_for(lambda: len(rx.free) == self.slots or rx.closed, timeout):
                held = self.slots - len(rx.free)
                raise TransportError(f"receiver at {self.address}: {held} batches still held")
            self._check()

    def _check(self) -> None:
        if self._closed:
            raise TransportError(f"sender to {self.address} is closed")
        if self._rx.closed:
            raise TransportError(f"receiver at {self.address} closed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rx.inbox.end()


def connect(
    address: str,
    *,
    timeout: float = 10.0,
    pipeline_id: int = 0,
    stage_id: int = 0,
    key: bytes | None = None,
) -> InprocSender:
    with _NAMESPACE:
        receiver = _LISTENING.get(address)
        # Nothing crosses a wire: a receiver's key is only checked, and a sender without it
        # leaves the receiver for the one that has it.
        wanted = None if receiver is None else receiver.key
        if wanted is not None and (key is None or not hmac.compare_digest(wanted, key)):
            raise TransportError(f"cannot connect to {address}: refused (not its key)")
        receiver = _LISTENING.pop(address, None)  # one sender per receiver, as with sockets
    if receiver is None:
        raise TransportError(f"cannot connect to {address}: nothing listens there")
    return InprocSender(receiver, pipeline_id, stage_id)


def listen(
    address: str, *, slots: int, slot_bytes: int, key: bytes | None = None
) -> InprocReceiver:
    with _NAMESPACE:
        if address in _LISTENING:
            raise TransportError(f"cannot listen on {address}: address in use")
        receiver = _LISTENING[address] = InprocReceiver(address, slots, slot_bytes)
        receiver.key = check_key(key)
    return receiver
