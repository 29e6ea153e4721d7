"""A sender maps only a shared-memory ring that is private to its own user: the segment a
receiver's WELCOME names is checked (owner, mode 600, size) on its descriptor before it is
mapped, so a WELCOME naming another program's segment cannot make the agent write into it."""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import secrets
from collections.abc import Iterator

import numpy as np
import pytest

from nicoffload.errors import TransportError
from nicoffload.transport import shm
from nicoffload.transport.frame import Welcome
from nicoffload.transport.slots import stride

SLOTS, SLOT_BYTES = 2, 4096
SIZE = SLOTS * stride(SLOT_BYTES)
FILL = 0x5A


@contextlib.contextmanager
def other_segment(mode: int, uid: int | None = None) -> Iterator[str]:
    """A segment of another program: the ring's size, filled with FILL, of `mode` (and `uid`)."""
    name = f"victim.{secrets.token_hex(4)}"
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
    try:
        os.ftruncate(fd, SIZE)
        os.fchmod(fd, mode)  # the umask does not get a say
        if uid is not None:
            os.fchown(fd, uid, -1)
        with mmap.mmap(fd, SIZE) as m:
            m[:] = bytes([FILL]) * SIZE
        yield name
    finally:
        os.close(fd)
        _posixshmem.shm_unlink("/" + name)


def untouched(name: str) -> bool:
    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    try:
        with mmap.mmap(fd, SIZE, prot=mmap.PROT_READ) as m:
            return m[:] == bytes([FILL]) * SIZE
    finally:
        os.close(fd)


def test_a_segment_others_may_open_is_refused_before_it_is_mapped() -> None:
    with other_segment(0o644) as name:
        with pytest.raises(TransportError, match="mode 644, not a private ring"):
            shm.Segment(name, SIZE, create=False)
        assert untouched(name)


def test_a_segment_of_mode_600_owned_by_another_user_is_refused() -> None:
    if os.geteuid() != 0:
        pytest.skip("making a segment owned by another user needs root")
    with other_segment(0o600, uid=os.geteuid() + 4242) as name:
        with pytest.raises(TransportError, match=f"owned by uid {os.geteuid() + 4242}"):
            shm.Segment(name, SIZE, create=False)
        assert untouched(name)


def test_a_private_segment_of_this_user_is_mapped() -> None:
    with other_segment(0o600) as name:
        seg = shm.Segment(name, SIZE, create=False)
        assert seg.array is not None and int(seg.array[0]) == FILL
        seg.close()


def test_a_welcome_naming_another_programs_segment_leaves_it_untouched() -> None:
    with (
        other_segment(0o666) as victim,
        shm.listen(f"shm://t{secrets.token_hex(4)}", slots=SLOTS, slot_bytes=SLOT_BYTES) as rx,
    ):
        rx._welcome = lambda: Welcome(SLOTS, SLOT_BYTES, victim)  # a lying receiver
        with pytest.raises(TransportError, match="not a private ring"):
            sender = shm.connect(rx.address, timeout=5)
            sender.send({"x": np.ones((1, 256), np.uint8)}, timeout=5)
        assert untouched(victim)
