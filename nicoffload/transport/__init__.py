"""Transports move a batch of tensors into a receiver's preallocated slot, then signal it.

Pick one by address: `connect("tcp://host:port")`, `listen("shm://name", slots=8, slot_bytes=...)`.
The wire format is in `frame`; the interface and the scheme registry in `base`.
"""

from nicoffload.transport.base import (
    Delivery,
    Receiver,
    Sender,
    Tensors,
    connect,
    listen,
    register_scheme,
    schemes,
)

__all__ = [
    "Delivery",
    "Receiver",
    "Sender",
    "Tensors",
    "connect",
    "listen",
    "register_scheme",
    "schemes",
]
