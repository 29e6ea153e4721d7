"""TCP transport (`tcp://host:port`): one connection per edge; the sender gathers the DATA head
and the tensors into sendmsg, the receiver's pump reads the payload straight into its slot. With
a key, every frame's MAC covers its payload too: a batch is handed out once its tag checks.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import OUT_OF_BAND, Header
from nicoffload.transport.slots import Layout, stride
from nicoffload.transport.stream import StreamReceiver, StreamSender

# Bigger than the autotuning ceiling on common kernels (net.ipv4.tcp_wmem max 4 MiB), so one
# sendmsg of a large batch is not cut into many wakeups. The kernel caps it at wmem_max x 2.
SEND_BUFFER = 16 << 20


def parse(address: str) -> tuple[str, int]:
    """(host, port) of a `tcp://host:port` address; TransportError if it is not one."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise TransportError(f"bad tcp address {address!r}: {exc}") from None
    if parts.scheme != "tcp" or not host or port is None or parts.path not in ("", "/"):
        raise TransportError(f"bad tcp address {address!r}: expected tcp://HOST:PORT")
    return host, port


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpSender(StreamSender):
    transport = "tcp"

    def _write(self, slot: int, arrays: list[np.ndarray], layout: Layout, request_id: int) -> None:
        self._ch.send(layout.announce(slot, request_id), layout.payload(arrays))


class TcpReceiver(StreamReceiver):
    transport = "tcp"
    read_ahead = True

    def _fill(self, ch: Channel, header: Header, slot: np.ndarray) -> None:
        if header.flags & OUT_OF_BAND:
            raise FrameError("malformed frame: flags: OUT_OF_BAND on a tcp connection")
        ch.read_into(memoryview(slot))

    def _accepted(self, sock: socket.socket) -> None:
        _tune(sock)


def connect(
    address: str,
    *,
    timeout: float = 10.0,
    pipeline_id: int = 0,
    stage_id: int = 0,
    key: bytes | None = None,
) -> TcpSender:
    host, port = parse(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TransportError(f"cannot connect to {address}: {exc}") from exc
    try:
        sock.settimeout(None)
        _tune(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        return TcpSender(
            address, sock, timeout=timeout, pipeline_id=pipeline_id, stage_id=stage_id, key=key
        )
    except BaseException:
        sock.close()
        raise


def listen(address: str, *, slots: int, slot_bytes: int, key: bytes | None = None) -> TcpReceiver:
    host, port = parse(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family, backlog=1)
    except OSError as exc:
        raise TransportError(f"cannot listen on {address}: {exc}") from exc
    try:
        real = listener.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        ring = np.empty(slots * stride(slot_bytes), np.uint8)
        return TcpReceiver(f"tcp://{shown}:{real}", listener, slots, slot_bytes, ring, key)
    except BaseException:
        listener.close()
        raise
