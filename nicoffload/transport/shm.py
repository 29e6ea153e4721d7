"""Shared-memory transport (`shm://name`): the ring is a POSIX shared-memory segment the sender
maps and memcpys into; DATA and CREDIT frames go over a Unix socket in the abstract namespace.
With a key, the sender proves it before it learns the segment's name, and the frames on the
socket carry a MAC; the payload in the segment does not (it never crosses a wire: the segment's
mode 600 and the sender's uid, checked on accept, are what keep others out of it).
"""

from __future__ import annotations

import _posixshmem  # what multiprocessing.shared_memory is built on
import contextlib
import mmap
import os
import re
import secrets
import socket
import stat
import struct
from multiprocessing import resource_tracker

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import OUT_OF_BAND, Header, Welcome
from nicoffload.transport.slots import Layout, slot_view, stride
from nicoffload.transport.stream import StreamReceiver, StreamSender

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class Segment:
    """A POSIX shared-memory segment mapped into this process, as a uint8 array.

    multiprocessing.shared_memory.SharedMemory would do, but on Python < 3.13 it registers every
    *attach* with the resource tracker (which then unlinks the receiver's segment when a sender
    exits, with a warning), and its close() raises BufferError while a view is alive. Here only
    the creator registers (so a crashed receiver's segment is still cleaned up), and close()
    leaves the mapping to the garbage collector while a Delivery still points into it.
    """

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name, self._owner = name, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        except OSError as exc:
            raise TransportError(f"shared memory {name!r}: {exc}") from exc
        if create:
            resource_tracker.register("/" + name, "shared_memory")
        try:
            if create:
                os.ftruncate(fd, size)
                try:  # the pages now: a full /dev/shm is ENOSPC here, not SIGBUS on first touch
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise TransportError(
                        f"shared memory {name!r}: cannot reserve {size} bytes ({exc}); "
                        "is /dev/shm large enough?"
                    ) from exc
            else:
                _check_private(name, os.fstat(fd), size)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.array: np.ndarray | None = np.frombuffer(self._mmap, np.uint8)
        _map_pages(self.array)

    def unlink(self) -> None:
        """Remove the name (the memory stays mapped wherever it is); idempotent."""
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + self.name)
            resource_tracker.unregister("/" + self.name, "shared_memory")

    def close(self) -> None:
        self.unlink()
        self.array = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # views alive: unmapped when they go
                self._mmap.close()
            self._mmap = None


def _map_pages(a: np.ndarray) -> None:
    """Map every page of the segment into this process now, a read of one byte each: the first
    write of a batch into pages not yet mapped here ran at 2.0-2.3 GB/s against 11 warm (81 MB,
    the 2-core VM), a cost that fell on a session's first call; the reads cost 9 ms for 144 MB
    there (the pages themselves are the creator's `posix_fallocate`)."""
    if a.size:
        a[:: mmap.PAGESIZE].max()


def _check_private(name: str, st: os.stat_result, size: int) -> None:
    """Map only a ring that a receiver of this user made for itself (owner ours, mode 600, the
    size it announced): never another program's segment that merely has the announced name."""
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600:
        raise TransportError(
            f"shared memory {name!r}: owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}, not a private ring of uid {os.geteuid()} (mode 600)"
        )
    if st.st_size != size:
        raise TransportError(f"shared memory {name!r}: {st.st_size} bytes, not {size}")


def parse(address: str) -> str:
    """The name in a `shm://name` address; TransportError if it is not one."""
    scheme, _, name = address.partition("://")
    if scheme != "shm" or not _NAME.fullmatch(name):
        raise TransportError(
            f"bad shm address {address!r}: expected shm://NAME, NAME of [A-Za-z0-9_.-]"
        )
    return name


def _socket_path(name: str) -> str:
    return "\0nicoffload.shm." + name  # abstract namespace: nothing on disk to clean up


class ShmSender(StreamSender):
    transport = "shm"
    out_of_band = True
    _segment: Segment | None = None

    def _attach(self, welcome: Welcome) -> None:
        if not _NAME.fullmatch(welcome.segment):
            raise FrameError(f"malformed frame: meta: segment name {welcome.segment!r}")
        self._segment = Segment(welcome.segment, self.slots * stride(self.slot_bytes), create=False)

    def _detach(self) -> None:
        if self._segment is not None:
            self._segment.close()

    def _write(self, slot: int, arrays: list[np.ndarray], layout: Layout, request_id: int) -> None:
        assert self._segment is not None and self._segment.array is not None
        layout.copy_into(slot_view(self._segment.array, slot, self.slot_bytes), arrays)
        self._ch.send(layout.announce(slot, request_id))


class ShmReceiver(StreamReceiver):
    transport = "shm"

    def __init__(
        self,
        address: str,
        listener: socket.socket,
        slots: int,
        slot_bytes: int,
        segment: Segment,
        key: bytes | None = None,
    ) -> None:
        self._segment = segment
        assert segment.array is not None
        super().__init__(address, listener, slots, slot_bytes, segment.array, key)

    def _welcome(self) -> Welcome:
        return Welcome(self.slots, self.slot_bytes, self._segment.name)

    def _accepted(self, sock: socket.socket) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.geteuid():
            raise TransportError(
                f"refused a sender of uid {uid} (the ring is private to {os.geteuid()})"
            )

    def _fill(self, ch: Channel, header: Header, slot: np.ndarray) -> None:
        if not header.flags & OUT_OF_BAND:
            raise FrameError("malformed frame: flags: shm DATA must be OUT_OF_BAND")

    def _on_ack(self) -> None:
        self._segment.unlink()  # the sender has it mapped: nothing can leak now, even on a crash

    def _free_ring(self) -> None:
        self._unpack.ring = np.empty(0, np.uint8)
        self._segment.close()


def connect(
    address: str,
    *,
    timeout: float = 10.0,
    pipeline_id: int = 0,
    stage_id: int = 0,
    key: bytes | None = None,
) -> ShmSender:
    name = parse(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(_socket_path(name))
        sock.settimeout(None)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot connect to {address}: {exc}") from exc
    try:
        return ShmSender(
            address, sock, timeout=timeout, pipeline_id=pipeline_id, stage_id=stage_id, key=key
        )
    except BaseException:
        sock.close()
        raise


def listen(address: str, *, slots: int, slot_bytes: int, key: bytes | None = None) -> ShmReceiver:
    name = parse(address)
    segment = Segment(
        f"nico.{name}.{secrets.token_hex(4)}", slots * stride(slot_bytes), create=True
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_socket_path(name))
        listener.listen(1)
        return ShmReceiver(address, listener, slots, slot_bytes, segment, key)
    except BaseException as exc:
        listener.close()
        segment.close()
        if isinstance(exc, OSError):
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        raise
