"""What `serve --fronts N`'s front processes and the Session's process say to each other: frames
on a Unix socket (a 4-byte length, then a pickled tuple: both ends are this program, started
by one another), and the slots of shared memory that carry the payloads.

Each front owns a pair of segments of `slots` slots of `slot_bytes` (made by the Session's
process, `nicoffload.transport.shm.Segment`: reserved with posix_fallocate, so a small /dev/shm
is an error at start, not a SIGBUS later): a request's items go into its request slot, its
outputs come back in the response slot of the same index, and the slot is free again once the
front has encoded the response. What does not fit a slot (or finds none free) travels in the
frame itself, and is counted (`inline`).

The messages: the front's `("ready", pid, event loop)` (`eventloop.chosen()`) and `("drained", pid)`; `("reqs", [request, ..])`,
the requests a front had ready in one turn of its event loop, each `(id, slot, in slot,
layout or items, arrived, parsed, deadline)`; `("anss", [answer, ..])`, the answers decided
in one round of the batcher, each `(id, status, error, timings, retry, decided, where,
outputs' layout or arrays)`; and the Session's `("drain",)` and, once every front has
drained, `("exit",)`.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import numpy as np

HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a frame past this is a broken peer, not a request (inline ones included)
# (name, offset, length, is text) of each input of each item, in the request slot
ItemLayout = list[list[tuple[str, int, int, bool]]]
# output name -> (dtype, shape, offset) in the response slot
OutputLayout = dict[str, tuple[str, tuple[int, ...], int]]


def frame(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=5)
    return HEADER.pack(len(data)) + data


def send(sock: socket.socket, msg: Any) -> None:
    sock.sendall(frame(msg))


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, at = memoryview(buf), 0
    while at < n:
        got = sock.recv_into(view[at:])
        if got == 0:
            return None
        at += got
    return bytes(buf)


def recv(sock: socket.socket) -> Any:
    """The next message, or None at the end of the stream (the peer closed or died)."""
    head = _exactly(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes, more than {MAX_FRAME}")
    data = _exactly(sock, n)
    return None if data is None else pickle.loads(data)


def read(stream: Any) -> Any:
    """The next message from a buffered reader (`socket.makefile("rb")`: many frames per
    system call under load), or None at the end of the stream."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes, more than {MAX_FRAME}")
    data = stream.read(n)
    return None if len(data) < n else pickle.loads(data)


def slot_bytes_for(output_bytes_per_item: int) -> int:
    """A slot's size: two items' outputs (or 256 KiB), in 64 KiB pages."""
    want = max(256 << 10, 2 * output_bytes_per_item)
    return -(-want // (64 << 10)) * (64 << 10)


def put_items(slot: np.ndarray, items: list[dict[str, Any]]) -> ItemLayout | None:
    """The items' bytes written into `slot`; their layout, or None when they do not fit."""
    layout: ItemLayout = []
    at = 0
    for item in items:
        row = []
        for name, value in item.items():
            text = isinstance(value, str)
            raw = value.encode("utf-8", "surrogatepass") if text else value
            n = len(raw)
            if at + n > len(slot):
                return None
            slot[at : at + n] = np.frombuffer(raw, np.uint8)
            row.append((name, at, n, text))
            at += n
        layout.append(row)
    return layout


def get_items(slot: np.ndarray, layout: ItemLayout) -> list[dict[str, Any]]:
    """The items back out of `slot` (copied: the slot is the front's again once answered)."""
    items = []
    for row in layout:
        item: dict[str, Any] = {}
        for name, at, n, text in row:
            raw = slot[at : at + n].tobytes()
            item[name] = raw.decode("utf-8", "surrogatepass") if text else raw
        items.append(item)
    return items


def put_outputs(slot: np.ndarray, outputs: dict[str, np.ndarray]) -> OutputLayout | None:
    """The outputs written into `slot`; their layout, or None when they do not fit (or are
    objects, such as a model's BYTES outputs, which have no raw bytes)."""
    layout: OutputLayout = {}
    at = 0
    for name, arr in outputs.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.hasobject or at + arr.nbytes > len(slot):
            return None
        slot[at : at + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        layout[name] = (arr.dtype.str, arr.shape, at)
        at += -(-arr.nbytes // 64) * 64  # each output 64-byte aligned
    return layout


def get_outputs(slot: np.ndarray, layout: OutputLayout) -> dict[str, np.ndarray]:
    """The outputs as views into `slot` (valid until the slot is given back)."""
    out = {}
    for name, (dtype, shape, at) in layout.items():
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        out[name] = slot[at : at + n].view(dt).reshape(shape)
    return out
