"""A session's batch slots as one shared-memory segment that every worker process maps: made by
the agent (`shared_slots`), viewed as each slot's arrays on both sides (`slot_views`), given
back whole when its session closes (`release`)."""

from __future__ import annotations

import contextlib
import math
import mmap
import secrets
from typing import Any

import numpy as np

from nicoffload.graph import TensorSpec
from nicoffload.transport.shm import Segment
from nicoffload.transport.slots import ALIGN


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def shared_slots(
    specs: dict[str, TensorSpec], batch: int, count: int
) -> tuple[Segment, list[list[Any]]]:
    """One segment holding `count` slots of the static outputs, and where each array lies:
    [[key, offset, dtype, shape], ...] per slot."""
    layout, at = [], 0
    for _ in range(count):
        slot = []
        for k, s in specs.items():
            if s.static:
                shape = [batch, *s.shape]
                slot.append([k, at, np.dtype(s.dtype).str, shape])
                at += aligned(math.prod(shape) * np.dtype(s.dtype).itemsize)
        layout.append(slot)
    seg = Segment(f"nicoffload-slots-{secrets.token_hex(8)}", max(at, ALIGN), create=True)
    return seg, layout


def slot_views(seg: Segment, layout: list[list[Any]]) -> list[dict[str, np.ndarray]]:
    """The arrays of each slot, as views of the segment."""
    buf = seg.array
    assert buf is not None
    out = []
    for slot in layout:
        arrays = {}
        for k, off, dtype, shape in slot:
            n = math.prod(shape) * np.dtype(dtype).itemsize
            arrays[k] = buf[off : off + n].view(dtype).reshape(shape)
        out.append(arrays)
    return out


def release(seg: Segment, views: list[dict[str, np.ndarray]]) -> None:
    """Give the segment's memory back now, once no worker maps it: the session's views are
    dropped (so the mapping can be closed) and its pages removed from /dev/shm even if a view
    survives somewhere (a batch in a reference cycle), which would otherwise hold the whole
    segment until the garbage collector ran, past the budget that was just given back."""
    for arrays in views:
        arrays.clear()  # the ring's slots hold these dicts: no view of the segment is left there
    buf = seg.array
    if buf is not None and isinstance(buf.base, memoryview) and isinstance(buf.base.obj, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):  # closed already, or not shmem
            buf.base.obj.madvise(mmap.MADV_REMOVE)
    del buf
    seg.close()
