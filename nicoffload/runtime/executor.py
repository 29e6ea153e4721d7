"""Executor: stream items through a plan's stages in batches on a worker pool.

One feeder thread admits items (bounded by the batch-slot ring: backpressure), worker threads
run each item through the bound kernels (which release the GIL) straight into its batch slot,
and the caller receives whole batches in order. A failing item is recorded with its reason and
never stops the run; any other exception in a worker is carried to the caller and re-raised.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, ItemError, SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.planner.plan import Plan
from nicoffload.runtime.buffers import BatchSlot, SlotRing
from nicoffload.runtime.stage import Stage

Item = tuple[str, Mapping[str, Any]]  # (name, {input name: bytes or str})
_END = object()


@dataclass(frozen=True)
class ItemFailure:
    index: int
    name: str
    reason: str
    detail: str


@dataclass
class Batch:
    """A finished batch. Arrays are views into a reused slot: valid until the next batch is taken."""

    index: int
    start: int  # index of the first item in the run
    names: list[str]
    outputs: dict[str, Any]  # static outputs: arrays (n, ...); ragged ones: lists
    ok: np.ndarray
    failures: list[ItemFailure]
    latencies_s: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class _Open:
    slot: BatchSlot
    index: int
    start: int
    names: list[str] = field(default_factory=list)
    admitted: list[float] = field(default_factory=list)
    failures: list[ItemFailure] = field(default_factory=list)
    pending: int = 0
    closed: bool = False
    done_at: float = 0.0


class Executor:
    """Runs the local stages of a plan. Use as a context manager; `stream(items)` yields Batches."""

    def __init__(
        self, pipeline: Pipeline, plan: Plan, workers: int | None = None, slots: int = 3
    ) -> None:
        plan.check_matches(pipeline)
        remote = [s for s in plan.stages if s.kind != "cpu"]
        if remote:
            raise DeviceError(
                f"stage '{remote[0].name}' is placed on '{remote[0].device}'; this executor runs host "
                "stages only; run the plan through nicoffload.run, which starts the device runtimes"
            )
        self.pipeline = pipeline
        self.plan = plan
        self.batch_size = pipeline.batch_max_size
        self.max_wait_s = pipeline.batch_max_wait_ms / 1000
        keep = {str(r) for r in pipeline.outputs.values()}
        self.stages = [Stage(pipeline, s, keep) for s in plan.stages]
        self.workers = workers or len(os.sched_getaffinity(0))
        self.out_refs = {name: str(ref) for name, ref in pipeline.outputs.items()}
        self._ring = SlotRing(pipeline.output_specs(), self.batch_size, slots)
        self.step_names = [st.name for stage in self.stages for st in stage.steps]
        self.step_ns = np.zeros(len(self.step_names), dtype=np.int64)
        self.step_items = np.zeros(len(self.step_names), dtype=np.int64)
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    def _process(
        self,
        values: dict[str, Any],
        slot: BatchSlot,
        row: int,
        step_ns: list[int],
        step_n: list[int],
    ) -> None:
        dests = {
            ref: slot.arrays[name][row]
            for name, ref in self.out_refs.items()
            if name in slot.arrays
        }
        offset = 0
        for stage in self.stages:
            n = len(stage.steps)
            ns, cnt = step_ns[offset : offset + n], step_n[offset : offset + n]
            try:
                stage.process(values, dests, ns, cnt)
            finally:
                step_ns[offset : offset + n], step_n[offset : offset + n] = ns, cnt
            offset += n
        for name, ref in self.out_refs.items():
            if name in slot.ragged:
                slot.ragged[name][row] = np.array(values[ref], copy=True)

    def stream(self, items: Iterable[Item]) -> Iterator[Batch]:
        """Process `items`; yield finished batches in order. A worker's crash is re-raised here."""
        work: queue.Queue[Any] = queue.Queue(maxsize=self.workers * 4)
        ready: dict[int, _Open] = {}
        cond = threading.Condition()
        failure: list[BaseException] = []
        total: list[int] = []  # the number of batches, once the feeder has seen the end
        stop = threading.Event()

        def finish_one(b: _Open) -> None:
            with cond:
                b.pending -= 1
                if b.closed and b.pending == 0:
                    b.done_at = time.perf_counter()
                    ready[b.index] = b
                    cond.notify_all()

        def worker() -> None:
            step_ns = [0] * len(self.step_names)
            step_n = [0] * len(self.step_names)
            while True:
                task = work.get()
                if task is _END:
                    break
                b, row, index, name, values = task
                try:
                    self._process(dict(values), b.slot, row, step_ns, step_n)
                except ItemError as exc:
                    with cond:
                        b.failures.append(ItemFailure(index, name, exc.reason, exc.detail))
                except BaseException as exc:  # carried to the consumer
                    with cond:
                        failure.append(exc)
                        cond.notify_all()
                    stop.set()
                finish_one(b)
            with self._lock:
                self.step_ns += np.array(step_ns, dtype=np.int64)
                self.step_items += np.array(step_n, dtype=np.int64)

        def close(b: _Open) -> None:
            with cond:
                b.closed = True
                b.pending -= 1  # the feeder's own hold on the batch
                if b.pending == 0:
                    b.done_at = time.perf_counter()
                    ready[b.index] = b
                    cond.notify_all()

        source: queue.Queue[Any] = queue.Queue(maxsize=self.batch_size * 2)

        def reader() -> None:
            try:
                for it in items:
                    if stop.is_set():
                        break
                    source.put(it)
            except BaseException as exc:
                with cond:
                    failure.append(exc)
                    cond.notify_all()
            source.put(_END)

        def feeder() -> None:
            index = batch_no = 0
            current: _Open | None = None
            while not stop.is_set():
                timeout = None
                if current is not None:
                    timeout = max(0.0, current.admitted[0] + self.max_wait_s - time.perf_counter())
                try:
                    it = source.get(timeout=timeout)
                except queue.Empty:
                    close(current)  # max_wait passed: ship the partial batch
                    current = None
                    continue
                if it is _END:
                    break
                if current is None:
                    current = _Open(self._ring.take(), batch_no, index, pending=1)
                    batch_no += 1
                name, values = it
                row = len(current.names)
                with cond:
                    current.names.append(name)
                    current.admitted.append(time.perf_counter())
                    current.pending += 1
                work.put((current, row, index, name, values))
                index += 1
                if len(current.names) == self.batch_size:
                    close(current)
                    current = None
            if current is not None:
                close(current)
            for _ in range(self.workers):
                work.put(_END)
            with cond:
                total.append(batch_no)
                cond.notify_all()

        threads = [
            threading.Thread(target=worker, name=f"nicoffload-worker-{i}", daemon=True)
            for i in range(self.workers)
        ]
        threads += [
            threading.Thread(target=reader, daemon=True),
            threading.Thread(target=feeder, daemon=True),
        ]
        for t in threads:
            t.start()
        next_index = 0
        try:
            while True:
                with cond:
                    while (
                        next_index not in ready
                        and not failure
                        and not (total and next_index >= total[0])
                    ):
                        cond.wait()
                    if failure:
                        raise SystemFailure(
                            f"runtime: a worker failed: {failure[0]!r}"
                        ) from failure[0]
                    if next_index not in ready:
                        break
                    b = ready.pop(next_index)
                next_index += 1
                yield self._to_batch(b)
                self._ring.give(b.slot)
        finally:
            stop.set()
            self._drain(work, source)

    def _drain(self, work: queue.Queue[Any], source: queue.Queue[Any]) -> None:
        for q in (work, source):
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for _ in range(self.workers):
            try:
                work.put_nowait(_END)
            except queue.Full:
                break

    def _to_batch(self, b: _Open) -> Batch:
        n = len(b.names)
        ok = np.ones(n, dtype=bool)
        for f in b.failures:
            ok[f.index - b.start] = False
        outputs: dict[str, Any] = {k: a[:n] for k, a in b.slot.arrays.items()}
        outputs.update({k: list(v[:n]) for k, v in b.slot.ragged.items()})
        for _k, a in b.slot.arrays.items():
            a[:n][~ok] = 0  # a failed row never carries a stale result from an earlier batch
        lat = b.done_at - np.array(b.admitted)
        return Batch(
            b.index,
            b.start,
            list(b.names),
            outputs,
            ok,
            sorted(b.failures, key=lambda f: f.index),
            lat,
        )

    def step_ms_per_item(self) -> dict[str, float]:
        with self._lock:
            return {
                name: (ns / 1e6 / cnt if cnt else 0.0)
                for name, ns, cnt in zip(
                    self.step_names, self.step_ns, self.step_items, strict=True
                )
            }
