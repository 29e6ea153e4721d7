"""Preallocated batch slots: every static output of a batch is written in place, never stacked.

A ring of `BatchSlot`s bounds the batches in flight; taking a slot blocks when all are in use,
which is the runtime's backpressure.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.graph import TensorSpec
from nicoffload.runtime.batch import Stamps


@dataclass
class BatchSlot:
    """Output arrays of one batch, shaped (max_size, *item_shape), plus per-row bookkeeping:
    `stamps` says which item wrote each row of each output, and `taken` counts the times the
    slot was taken, so a batch can tell that its slot went to another batch before it was done
    with it (both renewed by `renew`, when the slot is taken)."""

    index: int
    arrays: dict[str, np.ndarray]
    ragged: dict[str, list[object]] = field(default_factory=dict)
    stamps: Stamps = field(default_factory=lambda: Stamps((), 0))
    taken: int = 0

    def renew(self) -> int:
        """The slot goes to a new batch: no row is written yet. Returns its new `taken`."""
        self.stamps.reset()
        self.taken += 1
        return self.taken

    def row(self, r: int) -> dict[str, np.ndarray]:
        return {k: a[r] for k, a in self.arrays.items()}


class SlotRing:
    """`count` slots allocated once; `take()` blocks until one is free, `give()` returns it."""

    def __init__(
        self,
        specs: dict[str, TensorSpec],
        batch: int,
        count: int,
        arrays: list[dict[str, np.ndarray]] | None = None,
    ) -> None:
        """`arrays`: each slot's static outputs where they are to live (shared memory), else
        allocated here."""
        self._free: queue.Queue[BatchSlot] = queue.Queue()
        self._all: list[BatchSlot] = []
        for i in range(count):
            own = (
                arrays[i]
                if arrays is not None
                else {
                    k: np.zeros((batch, *s.shape), dtype=s.dtype)
                    for k, s in specs.items()
                    if s.static
                }
            )
            ragged = {k: [None] * batch for k, s in specs.items() if not s.static}
            self._all.append(BatchSlot(i, own, ragged, Stamps([*own, *ragged], batch)))
        self.reset()

    def reset(self) -> None:
        """Every slot free again: between calls, when no batch is in flight (a call that was
        abandoned did not give back the slots of the batches it never yielded)."""
        self._free = queue.Queue()
        for slot in self._all:
            self._free.put(slot)

    def take(self, timeout: float | None = None) -> BatchSlot:
        slot = self._free.get(timeout=timeout)
        slot.renew()
        return slot

    def give(self, slot: BatchSlot) -> None:
        self._free.put(slot)


def put_unless(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put `item` unless `stop` is set first (then False): a thread of a run that has ended
    never stays blocked on a full queue."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def drain(q: queue.Queue[Any], stop: threading.Event, end: object) -> Iterator[Any]:
    """What `q` yields up to the `end` sentinel, unless `stop` is set first: a reader of a run
    that has ended never stays blocked on an empty queue."""
    while not stop.is_set():
        try:
            item = q.get(timeout=0.1)
        except queue.Empty:
            continue
        if item is end:
            return
        yield item
