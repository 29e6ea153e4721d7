"""The all-GPU path: a plan that is one GPU stage, fed whole batches formed once at ingress.

No host stage runs between the items and the GPU, so nothing is done per item on the host but
taking it in: a reader thread appends items to the open batch, the GPU stage's feeding thread
takes a batch when it is full or its first item has waited `max_wait`, and the stage gets the
batch's encoded bytes as one list per input. Row status is numpy arrays: a row is ok only when
the GPU stage's first step produced a value for it and nothing failed it (`GpuBatch.produced`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import SystemFailure
from nicoffload.runtime.batch import Batch, ItemFailure, Stamps, settle

Item = tuple[str, Mapping[str, Any]]


@dataclass
class Taken:
    """One batch as it left ingress: its items' names, values per input, arrival times."""

    index: int
    start: int
    names: list[str]
    values: dict[str, list[Any]]
    admitted: np.ndarray


class Ingress:
    """Items into batches of up to `size`: `take()` returns the next batch, full or (once its
    first item has waited `wait_s`) partial, or None at the end. The reader stays at most
    `ahead` batches ahead of the taker (backpressure)."""

    def __init__(
        self, items: Iterable[Item], size: int, wait_s: float, keys: list[str], ahead: int = 2
    ) -> None:
        self.size, self.wait_s, self.keys = size, wait_s, keys
        self._limit = size * ahead
        self._cond = threading.Condition()
        self._items: list[Item] = []
        self._times: list[float] = []
        self._done = False
        self._stop = False
        self.error: BaseException | None = None  # raised by the items iterator
        self._batches = self._start = 0
        self._thread = threading.Thread(
            target=self._read, args=(items,), name="nicoffload-ingress", daemon=True
        )
        self._thread.start()

    def _read(self, items: Iterable[Item]) -> None:
        cond, buf, times, clock = self._cond, self._items, self._times, time.perf_counter
        try:
            for it in items:
                with cond:
                    while len(buf) >= self._limit and not self._stop:
                        cond.wait()
                    if self._stop:
                        return
                    buf.append(it)
                    times.append(clock())
                    if len(buf) == 1 or len(buf) == self.size:
                        cond.notify_all()
        except BaseException as exc:  # the caller's own iterator: re-raised to the caller
            self.error = exc
        with cond:
            self._done = True
            cond.notify_all()

    def stop(self) -> None:
        """No more items are read (the reader may still sit inside the caller's iterator)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def take(self) -> Taken | None:
        with self._cond:
            while True:
                if self._stop:
                    return None
                n = len(self._items)
                if n >= self.size or (n and self._done):
                    return self._cut(min(n, self.size))
                if self._done:
                    return None
                if not n:
                    self._cond.wait()
                    continue
                left = self._times[0] + self.wait_s - time.perf_counter()
                if left <= 0:
                    return self._cut(n)
                self._cond.wait(left)

    def _cut(self, n: int) -> Taken:
        items, times = self._items[:n], self._times[:n]
        del self._items[:n], self._times[:n]
        self._cond.notify_all()
        names = [name for name, _ in items]
        values = {k: [v.get(k) for _, v in items] for k in self.keys}
        taken = Taken(self._batches, self._start, names, values, np.array(times))
        self._batches += 1
        self._start += n
        return taken

    def __iter__(self) -> Iterator[Taken]:
        while (t := self.take()) is not None:
            yield t


class GpuDirect:
    """Runs a plan that is one GPU stage (`feed`, a GpuFeed): `stream(items)` yields Batches
    whose outputs are the stage's CUDA tensors (failed rows zeroed), handed over without a copy."""

    def __init__(self, feed: Any, refs: Mapping[str, str], size: int, wait_s: float) -> None:
        self.feed, self.refs, self.size, self.wait_s = feed, dict(refs), size, wait_s
        self.sink = f"gpu stage {feed.plan.name}"

    def stream(self, items: Iterable[Item], key: int = 0) -> Iterator[Batch]:
        ingress = Ingress(items, self.size, self.wait_s, list(self.feed.inputs))
        fed: list[Taken] = []

        def batches() -> Iterator[Mapping[str, list[Any]]]:
            for t in ingress:
                fed.append(t)
                yield t.values

        run = self.feed.run(batches())
        try:
            for gb in run:
                t = fed.pop(0)
                yield self._batch(t, gb, key)
            if ingress.error is not None:
                raise ingress.error
        finally:
            ingress.stop()
            run.close()  # joins the stage's threads

    def _batch(self, t: Taken, gb: Any, key: int) -> Batch:
        """The Batch of one finished GpuBatch: a row is ok when the stage produced it for its
        item (stamped here from `gb.produced`) and neither the stage nor its input failed it."""
        n = len(t.names)
        if gb.n != n:
            raise SystemFailure(
                f"runtime: the GPU stage returned {gb.n} rows for a batch of {n} items"
            )
        stamps = Stamps([self.sink], n)
        rows = np.flatnonzero(gb.produced)
        stamps.rows[self.sink][rows] = key + t.start + rows + 1
        failures = [
            ItemFailure(t.start + row, t.names[row], e.reason, e.detail)
            for row, e in sorted(gb.failures.items())
        ]
        ok, failures = settle(t.start, t.names, failures, [stamps], key)
        outputs = self.feed.outputs_of(gb, ok, self.refs)
        lat = time.perf_counter() - t.admitted
        return Batch(t.index, t.start, t.names, outputs, ok, failures, lat)
