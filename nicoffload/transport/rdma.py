"""RDMA transport (`rdma://host:port[?device=rxe0]`, the receiver's device) on verbs RC queue
pairs: the receiver's ring is one memory region; the sender RDMA WRITEs a batch into a slot, then
WRITE_WITH_IMM puts the DATA frame head in the slot's head area, the slot as the immediate;
credits come back as SEND_WITH_IMM. HELLO/WELCOME/ACK (QPN, PSN, GID, ring address, rkey) and
ERROR go over a TCP control connection. With a key, the sender proves it on that connection
before it learns the ring's address and rkey, and the frames on it carry a MAC; the verbs WRITEs
(payloads and DATA heads) bypass both CPUs and carry none (SECURITY.md says what that leaves).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport import gpudirect, verbs
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import (
    HEADER_SIZE,
    OUT_OF_BAND,
    Header,
    Kind,
    Welcome,
    decode_meta,
    encode,
    error_from_frame,
    head_size,
)
from nicoffload.transport.slots import (
    Delivery,
    Layout,
    Ledger,
    Packer,
    Unpacker,
    slot_view,
)
from nicoffload.transport.slots import stride as slot_stride
from nicoffload.transport.stream import (
    _EOF,
    HANDSHAKE_TIMEOUT,
    OneSenderReceiver,
    SlotSender,
    _expect,
)

DEVICE_ENV = "NICOFFLOAD_RDMA_DEVICE"  # this side's verbs device, when not the first one
HEAD_BYTES = 4096  # per slot: the DATA frame head (64-byte header + metadata) lands here
GRACE_S = 0.2  # after the control socket's EOF, completions already on their way still count
log = logging.getLogger(__name__)
_SHUTDOWN = encode(Header(Kind.SHUTDOWN))
_DONTWAIT = int(socket.MSG_DONTWAIT)


def parse(address: str) -> tuple[str, int, str | None, int | None]:
    """(host, port, device, gpu) of `rdma://HOST:PORT[?device=NAME][&gpu=N]`; TransportError
    otherwise. `gpu` asks a receiver for its ring in that GPU's memory where GPUDirect allows."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise TransportError(f"bad rdma address {address!r}: {exc}") from None
    if (
        parts.scheme != "rdma"
        or not host
        or port is None
        or parts.path not in ("", "/")
        or set(query) - {"device", "gpu"}
        or not all(v.isdigit() for v in query.get("gpu", []))
    ):
        raise TransportError(
            f"bad rdma address {address!r}: expected rdma://HOST:PORT[?device=NAME][&gpu=N]"
        )
    gpu = query.get("gpu", [None])[0]
    return host, port, query.get("device", [None])[0], None if gpu is None else int(gpu)


def _ring(slots: int, slot_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One buffer (what gets registered), its ring of slots, and its head areas after the ring."""
    size = slots * slot_stride(slot_bytes)
    buf = np.zeros(size + slots * HEAD_BYTES, np.uint8)
    return buf, buf[:size], buf[size:]


class RdmaSender(SlotSender):
    """Copies a batch into its own registered staging slot, then WRITEs it to the same slot of
    the receiver's ring: the receiver's memory is never touched by its CPU on the way in."""

    transport = "rdma"

    def __init__(
        self, address: str, sock: socket.socket, device: str, *, timeout: float, pipeline_id: int,
        stage_id: int, key: bytes | None = None,
    ) -> None:  # fmt: skip
        self._ep: verbs.Endpoint | None = None
        try:
            welcome = self._open(address, sock, timeout, key)
            peer, (remote, rkey), (heads, heads_rkey) = _remote(welcome.segment)
            self._ep = verbs.Endpoint(
                device, send_depth=2 * self.slots + 4, recv_depth=self.slots + 4
            )
            self._ep.connect(peer)
            self._buf, self._stage, self._heads = _ring(self.slots, self.slot_bytes)
            self._mr = self._ep.register(self._buf, remote=False)
            self._ring_addr, self._rkey = remote, rkey
            self._heads_addr, self._heads_rkey = heads, heads_rkey
            self._ch.send(encode(Header(Kind.ACK), self._ep.me.encode()))
            _expect(self._ch, Kind.ACK, timeout)  # the receiver's QP is ready to receive
        except BaseException as exc:
            if hasattr(self, "_ch"):
                self._ch.close()
            self._detach()
            if isinstance(exc, OSError):
                raise TransportError(f"cannot connect to {address}: {exc}") from exc
            raise
        self._pack = Packer(self.slot_bytes, OUT_OF_BAND, pipeline_id, stage_id)

    def _admit(self, layout: Layout) -> None:
        if len(layout.head) > HEAD_BYTES:
            raise TransportError(
                f"a batch head of {len(layout.head)} bytes (header and metadata) does not fit "
                f"the {HEAD_BYTES}-byte head area of an rdma slot: send less metadata"
            )

    def _write(self, slot: int, arrays: list[np.ndarray], layout: Layout, request_id: int) -> None:
        head_len = len(layout.head)
        layout.copy_into(slot_view(self._stage, slot, self.slot_bytes), arrays)
        at = slot * HEAD_BYTES
        self._heads[at : at + head_len] = np.frombuffer(layout.announce(slot, request_id), np.uint8)
        ep, start = self._ep, slot * slot_stride(self.slot_bytes)
        assert ep is not None
        if layout.nbytes:
            ep.write(self._mr, start, layout.nbytes, self._rkey, self._ring_addr + start)
        head_at = self._stage.nbytes + at
        ep.write_imm(self._mr, head_at, head_len, self._heads_rkey, self._heads_addr + at, slot)

    def _take_credits(self, timeout: float | None) -> None:
        assert self._ep is not None
        for imm in self._ep.wait_recv(timeout, also=self._ch.sock.fileno()):
            if imm == verbs.IMM_GOODBYE:
                raise TransportError(f"{self._ch.peer} closed")
            if imm not in self._out:
                raise FrameError(f"malformed frame: slot: credit for slot {imm}, not out")
            self._out.remove(imm)
            self._free.append(imm)
        if self._ch.readable(0):
            got = self._ch.read_head(0)
            if got is None:
                raise TransportError(f"{self._ch.peer} closed the connection")
            if got[0].kind is Kind.ERROR:
                raise error_from_frame(got[1], self._ch.peer)
            if got[0].kind is Kind.SHUTDOWN:
                raise TransportError(f"{self._ch.peer} closed")
            raise FrameError(f"malformed frame: kind: unexpected {got[0].kind.name}")

    def _detach(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        ep = self._ep
        if self._broken is None and ep is not None:
            # The goodbye follows the last WRITE on the same QP (so the receiver sees every batch
            # first); wait for its ack before the control socket goes, so EOF never overtakes it.
            try:
                ep.send_imm(verbs.IMM_GOODBYE)
                ep.drain_sends(1.0)
            except TransportError as exc:
                log.debug("%s: goodbye not delivered: %s", self.address, exc)
            self._ch.post(_SHUTDOWN, _DONTWAIT)
        self._ch.shutdown()  # wakes a send() blocked on credits in another thread
        with self._lock:
            self._ch.close()
            self._detach()


def _remote(segment: str) -> tuple[verbs.Peer, tuple[int, int], tuple[int, int]]:
    """The receiver's endpoint, its ring (address, rkey) and its head areas (address, rkey):
    two regions, since a GPU ring's heads stay in host memory for the receiver's CPU."""
    try:
        peer, addr, rkey, heads, heads_rkey = segment.split("|")
        return verbs.Peer.decode(peer), (int(addr), int(rkey)), (int(heads), int(heads_rkey))
    except ValueError:
        raise FrameError(f"malformed frame: meta: rdma endpoint {segment!r}") from None


class RdmaReceiver(OneSenderReceiver):
    """Owns the registered ring; the helper thread accepts one sender and connects the QPs, then
    recv waits on the completion channel and the control socket in the caller's thread."""

    transport = "rdma"

    def __init__(
        self,
        address: str,
        listener: socket.socket,
        device: str,
        slots: int,
        slot_bytes: int,
        gpu: int | None = None,
        key: bytes | None = None,
    ) -> None:
        self._ep = verbs.Endpoint(device, send_depth=slots + 4, recv_depth=slots + 4)
        self.destination: gpudirect.Destination | None = None
        self._gpu_ring: gpudirect.GpuRing | None = None
        try:
            ring, ring_mr, self._heads, heads_mr = self._regions(device, slots, slot_bytes, gpu)
            self._segment = "|".join(
                map(str, (self._ep.me.encode(), ring_mr.buf, ring_mr.rkey, heads_mr.buf,
                          heads_mr.rkey))
            )  # fmt: skip
            self._unpack = Unpacker(ring, slot_bytes)
            self._ledger = Ledger(f"receiver at {address}")
            self._queue: collections.deque[Delivery] = collections.deque()
            super().__init__(address, listener, slots, slot_bytes, key)
        except BaseException:
            self._ep.close()
            if self._gpu_ring is not None:
                self._gpu_ring.close()
            raise

    def _regions(
        self, device: str, slots: int, slot_bytes: int, gpu: int | None
    ) -> tuple[Any, Any, np.ndarray, Any]:
        """The ring and the head areas, each registered as a region of its own: the ring in GPU
        memory where GPUDirect is possible and asked for (`gpu`), else in host memory (which a
        GpuLanding can copy to the GPU); the heads always in host memory."""
        if gpu is not None:
            self.destination = gpudirect.choose(gpudirect.probe(device), gpudirect.supported())
        if self.destination is not None and self.destination.gpudirect:
            self._gpu_ring = gpudirect.GpuRing(gpu or 0, slots * slot_stride(slot_bytes))
            ring_mr = gpudirect.register(self._ep, self._gpu_ring, self.destination.kind)
            heads = np.zeros(slots * HEAD_BYTES, np.uint8)
            return self._gpu_ring.array, ring_mr, heads, self._ep.register(heads, remote=True)
        _, ring, heads = _ring(slots, slot_bytes)  # two views of one buffer (they keep it)
        ring_mr = self._ep.register(ring, remote=True)
        return ring, ring_mr, heads, self._ep.register(heads, remote=True)

    def _shake(self, ch: Channel) -> None:
        self._welcome_sender(ch, Welcome(self.slots, self.slot_bytes, self._segment))
        peer = verbs.Peer.decode(decode_meta(_expect(ch, Kind.ACK, HANDSHAKE_TIMEOUT), str))
        self._ep.connect(peer)
        ch.send(encode(Header(Kind.ACK)))

    def recv(self, timeout: float | None = None) -> Delivery | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._recv_lock:
            ch = self._sender(timeout)
            while not self._queue:
                if self._final is _EOF:
                    return None
                if self._final is not None:
                    raise self._final  # type: ignore[misc]
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                with self._final_on_error(ch):
                    got = self._step(ch, left)
                waited_out = deadline is not None and time.monotonic() >= deadline
                if not got and not self._queue and self._final is None and waited_out:
                    raise TransportError(f"receiver at {self.address}: no batch within {timeout} s")
            return self._ledger.hand_out(self._queue.popleft())

    def _step(self, ch: Channel, timeout: float | None) -> bool:
        """Take what the completion queue and the control socket hold; True if anything came."""
        imms = self._ep.wait_recv(timeout, also=ch.sock.fileno())
        self._take(imms)
        if self._final is None and ch.readable(0):
            got = ch.read_head(0)
            if self._closed:
                raise TransportError(f"receiver at {self.address} is closed")
            if got is None or got[0].kind is Kind.SHUTDOWN:
                # The goodbye (a completion) may still be on its way: wait for it a moment.
                end = time.monotonic() + GRACE_S
                while self._final is None and time.monotonic() < end:
                    self._take(self._ep.wait_recv(0.01))
                if self._final is None:
                    raise TransportError(f"{ch.peer}: disconnected without SHUTDOWN")
            elif got[0].kind is Kind.ERROR:
                raise error_from_frame(got[1], ch.peer)
            elif got[0].kind is not Kind.HEARTBEAT:
                raise FrameError(f"malformed frame: kind: unexpected {got[0].kind.name}")
            return True
        return bool(imms)

    def _take(self, imms: list[int]) -> None:
        for imm in imms:
            if self._final is not None:
                raise FrameError(f"malformed frame: a batch after the goodbye (immediate {imm})")
            if imm == verbs.IMM_GOODBYE:
                self._final = _EOF
                continue
            if imm >= self.slots:
                raise FrameError(f"malformed frame: slot: immediate {imm}, ring of {self.slots}")
            head = self._heads[imm * HEAD_BYTES : (imm + 1) * HEAD_BYTES]
            size = head_size(head[:HEADER_SIZE].tobytes())
            if size > HEAD_BYTES:
                raise FrameError(f"malformed frame: meta_len: a head of {size} bytes")
            raw = head[:size].tobytes()
            header = Header.unpack(raw, max_payload=self.slot_bytes)
            if header.kind is not Kind.DATA or not header.flags & OUT_OF_BAND:
                raise FrameError("malformed frame: kind: rdma heads are OUT_OF_BAND DATA")
            if header.slot != imm:
                raise FrameError(f"malformed frame: slot: head says {header.slot}, immediate {imm}")
            delivery = self._unpack(header, raw[HEADER_SIZE:])
            self._ledger.claim(header)
            self._queue.append(delivery)

    def release(self, delivery: Delivery) -> None:
        if not self._ledger.take_back(delivery) or self._ch is None or self._final is not None:
            return
        try:
            self._ep.send_imm(delivery.slot)
        except TransportError as exc:  # the sender is gone: recv says how
            log.debug("%s: credit not sent: %s", self.address, exc)

    def _free(self) -> None:
        self._ledger.close()
        self._queue.clear()
        self._ep.close()
        if self._gpu_ring is not None:
            self._gpu_ring.close()


def connect(
    address: str,
    *,
    timeout: float = 10.0,
    pipeline_id: int = 0,
    stage_id: int = 0,
    key: bytes | None = None,
) -> RdmaSender:
    host, port, _, _ = parse(address)  # ?device=, ?gpu= are the receiver's, not this side's
    device = verbs.pick_device(os.environ.get(DEVICE_ENV))
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TransportError(f"cannot connect to {address}: {exc}") from exc
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return RdmaSender(
            address, sock, device, timeout=timeout, pipeline_id=pipeline_id, stage_id=stage_id,
            key=key,
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise


def listen(address: str, *, slots: int, slot_bytes: int, key: bytes | None = None) -> RdmaReceiver:
    host, port, wanted, gpu = parse(address)
    device = verbs.pick_device(wanted or os.environ.get(DEVICE_ENV))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.create_server((host, port), family=family, backlog=1)
    except OSError as exc:
        raise TransportError(f"cannot listen on {address}: {exc}") from exc
    try:
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        query = "&".join(f"{k}={v}" for k, v in (("device", wanted), ("gpu", gpu)) if v is not None)
        real = f"rdma://{shown}:{listener.getsockname()[1]}{'?' + query if query else ''}"
        return RdmaReceiver(real, listener, device, slots, slot_bytes, gpu, key)
    except BaseException:
        listener.close()
        raise
