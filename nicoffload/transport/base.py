"""The transport interface: a Sender writes a batch of tensors into a free slot of a Receiver's
ring and signals it; the Receiver hands out zero-copy views and returns a credit on release.

`connect(address)` and `listen(address, ...)` pick the implementation by the address's scheme.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import queue
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.frame import (
    DataMeta,
    DType,
    Header,
    Kind,
    TensorEntry,
    decode_meta,
    encode_meta,
)

ALIGN = 64  # each tensor starts on a cache line of its slot (and a DMA-friendly boundary)
MAX_SLOTS = 1 << 16  # the header's slot field is a u16

_PAD = np.zeros(ALIGN, np.uint8)

Tensors = Mapping[str, np.ndarray] | Sequence[np.ndarray]


def stride(slot_bytes: int) -> int:
    """Distance between slots in a ring: slot_bytes rounded up so every slot starts ALIGN-ed."""
    return -(-slot_bytes // ALIGN) * ALIGN


def slot_view(ring: np.ndarray, slot: int, slot_bytes: int) -> np.ndarray:
    """The uint8 array over one slot of `ring`."""
    start = slot * stride(slot_bytes)
    return ring[start : start + slot_bytes]


@dataclass(frozen=True, eq=False)
class Delivery:
    """One batch in a receiver's slot. `tensors` are views into the slot: valid until release."""

    slot: int
    request_id: int
    batch_size: int
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


@dataclass(frozen=True, eq=False)
class Layout:
    """A batch laid out for a slot: `arrays[i]` at byte `offsets[i]`, `nbytes` in all."""

    arrays: tuple[np.ndarray, ...]
    offsets: tuple[int, ...]
    meta: bytes  # the DATA frame's metadata blob
    nbytes: int
    batch_size: int
    dtype: DType
    shape: tuple[int, ...]

    def head(
        self, slot: int, request_id: int, flags: int = 0, pipeline_id: int = 0, stage_id: int = 0
    ) -> bytes:
        """The DATA frame's header and metadata announcing this batch in `slot`."""
        header = Header(
            Kind.DATA,
            flags,
            pipeline_id,
            stage_id,
            slot,
            request_id,
            self.batch_size,
            len(self.meta),
            self.nbytes,
            self.dtype,
            self.shape,
        )
        return header.pack(self.meta) + self.meta

    def flat(self) -> list[np.ndarray]:
        """The payload as it lies in the slot: each array as contiguous bytes (copied only if
        the input was not contiguous), with the ALIGN padding between them."""
        out, at = [], 0
        for a, start in zip(self.arrays, self.offsets, strict=True):
            if start > at:
                out.append(_PAD[: start - at])
            if a.nbytes:
                out.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            at = start + a.nbytes
        return out

    def copy_into(self, slot: np.ndarray) -> None:
        """memcpy every array into `slot` (a uint8 array over the receiver's slot)."""
        for a, start in zip(self.arrays, self.offsets, strict=True):
            if a.nbytes:
                np.copyto(slot[start : start + a.nbytes].view(a.dtype).reshape(a.shape), a)


def lay_out(
    tensors: Tensors,
    slot_bytes: int,
    *,
    batch_size: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Layout:
    """Place `tensors` one after the other (ALIGN-ed) in a slot; TransportError if they don't fit.

    A sequence is named "0", "1", ...; `batch_size` defaults to the first tensor's leading dim.
    """
    if not isinstance(tensors, Mapping):
        tensors = {str(i): a for i, a in enumerate(tensors)}
    arrays, entries, offset = [], [], 0
    for name, value in tensors.items():
        a = np.asarray(value)
        try:
            code = DType.of(a.dtype)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        entries.append(TensorEntry(name, code, a.shape, offset))
        arrays.append(a)
        offset += -(-a.nbytes // ALIGN) * ALIGN
    nbytes = entries[-1].offset + arrays[-1].nbytes if arrays else 0
    if nbytes > slot_bytes:
        sizes = ", ".join(f"{e.name}: {a.nbytes}" for e, a in zip(entries, arrays, strict=True))
        raise TransportError(
            f"a batch of {nbytes} bytes does not fit a {slot_bytes}-byte slot ({sizes})"
        )
    if batch_size is None:
        batch_size = arrays[0].shape[0] if arrays and arrays[0].ndim else int(bool(arrays))
    dtype, shape = DType.NONE, ()
    # A lone tensor also goes into the fixed header, where a NIC parser can see it.
    if len(arrays) == 1 and 1 <= arrays[0].ndim <= 5 and arrays[0].shape[0] == batch_size:
        dtype, shape = DType(entries[0].dtype), arrays[0].shape[1:]
    blob = encode_meta(DataMeta(tuple(entries), dict(meta or {})))
    offsets = tuple(e.offset for e in entries)
    return Layout(tuple(arrays), offsets, blob, nbytes, batch_size, dtype, shape)


_TENSOR_DTYPES = frozenset(d.value for d in DType if d is not DType.NONE)


def open_delivery(ring: np.ndarray, slot_bytes: int, header: Header, meta: bytes) -> Delivery:
    """The Delivery a DATA frame announces, as views into `ring`; FrameError if it lies."""
    slots = len(ring) // stride(slot_bytes)
    if header.slot >= slots:
        raise FrameError(f"malformed frame: slot: {header.slot}, the ring has {slots} slots")
    if header.payload_len > slot_bytes:
        raise FrameError(
            f"malformed frame: payload_len: {header.payload_len} > slot of {slot_bytes}"
        )
    data = decode_meta(meta, DataMeta)
    base = header.slot * stride(slot_bytes)
    tensors = {}
    for e in data.tensors:
        if e.dtype not in _TENSOR_DTYPES:
            raise FrameError(f"malformed frame: meta: tensor {e.name!r} has dtype code {e.dtype}")
        dt = DType(e.dtype).numpy
        if min(e.shape, default=0) < 0 or len(e.shape) > 32 or e.offset < 0:
            raise FrameError(
                f"malformed frame: meta: tensor {e.name!r} has shape {e.shape}, offset {e.offset}"
            )
        end = e.offset + math.prod(e.shape) * dt.itemsize
        if end > header.payload_len:
            raise FrameError(
                f"malformed frame: meta: tensor {e.name!r} ends at {end}, "
                f"past payload_len {header.payload_len}"
            )
        view = ring[base + e.offset : base + end]
        tensors[e.name] = view.view(dt).reshape(e.shape)
    if len(tensors) != len(data.tensors):
        raise FrameError("malformed frame: meta: two tensors share a name")
    return Delivery(header.slot, header.request_id, header.batch_size, tensors, data.user)


class Sender(ABC):
    """Writes batches into a receiver's slots; `send` blocks while the receiver holds them all."""

    address: str
    slots: int
    slot_bytes: int

    @abstractmethod
    def send(
        self,
        tensors: Tensors,
        *,
        request_id: int = 0,
        batch_size: int | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Write one batch into a free slot and signal it; returns the slot.

        Blocks until a slot is free (TransportError after `timeout` s; None waits for ever).
        """

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Wait until the receiver has released every batch sent so far."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye (the receiver's recv then returns None) and free resources; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Receiver(ABC):
    """Owns a ring of `slots` slots of `slot_bytes` bytes that one sender writes batches into."""

    address: str  # what a sender connects to (the real port when listening on port 0)
    slots: int
    slot_bytes: int

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Delivery | None:
        """The next batch; None once the sender has closed. TransportError on timeout or failure."""

    @abstractmethod
    def release(self, delivery: Delivery) -> None:
        """Give the delivery's slot back to the sender (its views become invalid)."""

    @abstractmethod
    def close(self) -> None:
        """Stop receiving and free the ring; idempotent. A blocked recv raises TransportError."""

    def __iter__(self) -> Iterator[Delivery]:
        while (delivery := self.recv()) is not None:
            yield delivery

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Inbox:
    """Deliveries handed from whoever fills the ring to recv(), then EOF or an error, for good."""

    _EOF = object()

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._final: object | None = None
        self.closed = False
        self.busy: set[int] = set()  # slots announced and not released yet
        self.held: dict[int, Delivery] = {}  # of those, the ones recv handed out

    def claim(self, header: Header) -> None:
        """Mark a DATA frame's slot busy; FrameError if the sender had no credit for it."""
        if header.slot in self.busy:
            raise FrameError(
                f"malformed frame: slot: DATA for slot {header.slot}, which the "
                "receiver still holds (the sender had no credit for it)"
            )
        self.busy.add(header.slot)

    def put(self, delivery: Delivery) -> None:
        self._queue.put(delivery)

    def end(self, error: BaseException | None = None) -> None:
        """No more deliveries: EOF, or `error` raised by every later recv."""
        self._queue.put(self._EOF if error is None else error)

    def close(self, error: BaseException) -> None:
        """The receiver closed: drop what is queued and held (so the ring can be unmapped)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self.closed = True
        self.held.clear()
        self.busy.clear()
        self.end(error)

    def get(self, timeout: float | None) -> Delivery | None:
        item = self._final
        if item is None:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TransportError(f"{self._name}: no batch within {timeout} s") from None
        if isinstance(item, Delivery):
            self.held[item.slot] = item
            return item
        self._final = item
        if isinstance(item, BaseException):
            raise item
        return None

    def take_back(self, delivery: Delivery) -> bool:
        """Check that `delivery` is held here and mark its slot free; False once closed."""
        if self.closed:
            return False
        if self.held.get(delivery.slot) is not delivery:
            raise ValueError(
                f"{self._name}: slot {delivery.slot} is not held by this delivery "
                "(released twice, or from another receiver)"
            )
        del self.held[delivery.slot]
        self.busy.discard(delivery.slot)
        return True


# --- addresses --------------------------------------------------------------------------------

# scheme -> module defining `connect(address, **kw) -> Sender` and `listen(address, **kw) -> Receiver`
_SCHEMES: dict[str, str] = {
    "inproc": "nicoffload.transport.inproc",
    "shm": "nicoffload.transport.shm",
    "tcp": "nicoffload.transport.tcp",
}


def register_scheme(scheme: str, module: str) -> None:
    """Make `scheme://` addresses go to `module` (imported on first use), e.g. rdma."""
    if scheme in _SCHEMES:
        raise ValueError(f"transport scheme {scheme!r} is already registered ({_SCHEMES[scheme]})")
    _SCHEMES[scheme] = module


def schemes() -> tuple[str, ...]:
    return tuple(sorted(_SCHEMES))


def _module(address: str) -> Any:
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise TransportError(
            f"bad transport address {address!r}: expected SCHEME://..., "
            f"SCHEME one of {', '.join(schemes())}"
        )
    return importlib.import_module(_SCHEMES[scheme])


def connect(
    address: str, *, timeout: float = 10.0, pipeline_id: int = 0, stage_id: int = 0
) -> Sender:
    """A Sender connected to the receiver listening at `address` (`tcp://h:p`, `shm://name`...)."""
    return _module(address).connect(
        address, timeout=timeout, pipeline_id=pipeline_id, stage_id=stage_id
    )


def listen(address: str, *, slots: int, slot_bytes: int) -> Receiver:
    """A Receiver with a ring of `slots` x `slot_bytes` bytes, waiting for one sender."""
    if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
        raise ValueError(
            f"need 1 <= slots <= {MAX_SLOTS} and slot_bytes >= 1, got {slots}, {slot_bytes}"
        )
    return _module(address).listen(address, slots=slots, slot_bytes=slot_bytes)
