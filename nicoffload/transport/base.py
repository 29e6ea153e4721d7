"""The transport interface: a Sender writes a batch of tensors into a free slot of a Receiver's
ring and signals it; the Receiver hands out zero-copy views and returns a credit on release.

`connect(address)` and `listen(address, ...)` pick the implementation by the address's scheme.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, Self

from nicoffload.errors import TransportError
from nicoffload.transport.frame import MAX_PAYLOAD
from nicoffload.transport.slots import Delivery, Tensors

__all__ = ["Delivery", "Receiver", "Sender", "Tensors", "connect", "listen", "register_scheme"]
MAX_SLOTS = 1 << 16  # the header's slot field is a u16


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


# --- addresses --------------------------------------------------------------------------------

# scheme -> module defining `connect(address, **kw) -> Sender` and `listen(address, **kw) -> Receiver`
_SCHEMES: dict[str, str] = {
    "inproc": "nicoffload.transport.inproc",
    "rdma": "nicoffload.transport.rdma",
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
    address: str,
    *,
    timeout: float = 10.0,
    pipeline_id: int = 0,
    stage_id: int = 0,
    key: bytes | None = None,
) -> Sender:
    """A Sender connected to the receiver listening at `address` (`tcp://h:p`, `shm://name`...).

    `key` (32 bytes or more, shared with the receiver): prove it to a receiver that has one;
    the connection's frames then carry a MAC (`transport.integrity`)."""
    extra = {} if key is None else {"key": key}
    return _module(address).connect(
        address, timeout=timeout, pipeline_id=pipeline_id, stage_id=stage_id, **extra
    )


def listen(address: str, *, slots: int, slot_bytes: int, key: bytes | None = None) -> Receiver:
    """A Receiver with a ring of `slots` x `slot_bytes` bytes, waiting for one sender; with a
    `key`, only for a sender that proves it holds the key (others are refused, and it goes on
    waiting), and every frame from it is checked against its MAC."""
    if not (1 <= slots <= MAX_SLOTS and 1 <= slot_bytes <= MAX_PAYLOAD):
        raise ValueError(
            f"need 1 <= slots <= {MAX_SLOTS} and 1 <= slot_bytes <= {MAX_PAYLOAD}, "
            f"got {slots}, {slot_bytes}"
        )
    extra = {} if key is None else {"key": key}
    return _module(address).listen(address, slots=slots, slot_bytes=slot_bytes, **extra)
