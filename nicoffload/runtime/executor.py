"""Executor: stream items through a plan's stages in batches on a worker pool.

A feeder admits items in order (bounded by the batch-slot ring: backpressure) and routes each
one: to the DPU agent when the plan starts with a DPU stage (`RemoteFront`), else straight to the
host workers. Workers run an item through its host stages (kernels release the GIL) into its
batch slot (or the pinned staging rows of a trailing GPU stage, `GpuFeed`, which then runs each
finished batch in order); the caller receives whole batches in order. A failing item is recorded
with its reason and never stops the run; an agent that dies has its unfinished items run on the
host; any other exception in a worker is carried to the caller and re-raised.

This is the fast path for the shapes it was tuned for ([a DPU stage] -> host CPU stages -> [a GPU
stage]); every other stage sequence runs on the general path (`runtime.chain`, which
`chain.executor_for` picks).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from nicoffload.errors import AgentError, DeviceError, ItemError, SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import host_share, ring_slots
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.runtime.assist import HostAssist
from nicoffload.runtime.batch import Batch, ItemFailure, settle
from nicoffload.runtime.buffers import BatchSlot, SlotRing, put_unless
from nicoffload.runtime.delivered import delivers_outputs, place_rows
from nicoffload.runtime.gpu_direct import GpuDirect
from nicoffload.runtime.gpu_feed import GpuFeed, GpuRows
from nicoffload.runtime.remote import RERUN_WHY, RemoteFront, failover_reason, leaving, split_rerun
from nicoffload.runtime.stage import Stage, StepTime, split_stages

__all__ = ["Batch", "Executor", "ItemFailure", "split_stages"]

Item = tuple[str, Mapping[str, Any]]  # (name, {input name: bytes or str})
_END = object()
POLL_S = 0.1  # how often a feeder with no batch open checks that the call goes on


@dataclass
class _Open:
    slot: BatchSlot
    index: int
    start: int
    names: list[str] = field(default_factory=list)
    admitted: list[float] = field(default_factory=list)
    failures: list[ItemFailure] = field(default_factory=list)
    pending: int = 1  # the feeder's own hold until the batch is closed
    done_at: float = 0.0
    gpu: GpuRows | None = None  # the GPU stage's input rows, when the plan ends on the GPU
    ok: np.ndarray | None = None  # set once every row is settled (`Executor._settle`)
    taken: int = 0  # the slot's `taken` when this batch took it
    key: int = 0  # added to an item's index in its row stamps: the call's own
    # per-row perf_counter stamps for serving's per-request breakdown (`Batch.row_times`):
    # when the batch went to the agent, each row's delivery from it, each row's work done
    closed_at: float = 0.0
    delivered: dict[int, float] = field(default_factory=dict)
    finished: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.taken = self.slot.taken

    def check_slot(self, when: str) -> None:
        """SystemFailure if the slot went to another batch: rows read from it may be wrong."""
        if self.slot.taken != self.taken:
            raise SystemFailure(
                f"runtime: the slot of batch {self.index} was taken by another batch {when}; "
                "its rows cannot be trusted"
            )


@dataclass
class _Task:
    batch: _Open
    row: int
    index: int
    name: str
    values: Mapping[str, Any]
    route: tuple[Stage, ...] = ()
    release: Callable[[], None] | None = None
    rid: int = 0  # its request id at the DPU agent, once submitted
    assisted: bool = False  # the host runs its DPU stage: the agent was busy (host assist)


class Executor:
    """Runs a plan. Use as a context manager; `stream(items)` yields Batches in order.

    A plan is [a DPU stage] + host CPU stages + [a GPU stage]: the DPU stage is served by
    `front` (its nodes are also bound on the host, for failover), the GPU stage by a `GpuStage`
    (`gpu_stage` stands in for it in tests), the rest runs here on the host CPU.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        plan: Plan,
        workers: int | None = None,
        slots: int = 3,
        front: RemoteFront | None = None,
        gpu_stage: Any = None,
    ) -> None:
        plan.check_matches(pipeline)
        lead, stages, tail = split_stages(plan)
        if lead is not None and front is None:
            raise DeviceError(f"stage '{lead.name}' needs a DPU agent for '{lead.device}'")
        self.pipeline, self.plan, self.front = pipeline, plan, front
        self.batch_size = pipeline.batch_max_size
        self.max_wait_s = pipeline.batch_max_wait_ms / 1000
        keep = {str(r) for r in pipeline.outputs.values()}
        # without host stages nothing writes the GPU stage's rows in place: they are collected
        # (landed in GPU memory already when a DPU stage feeds the GPU stage through a landing)
        self.gpu = None if tail is None else GpuFeed(pipeline, tail, keep, gpu_stage, bool(stages))
        host_keep = keep | set(self.gpu.inputs if self.gpu else ())
        self.host = tuple(Stage(pipeline, s, host_keep) for s in stages)
        self.fallback: tuple[Stage, ...] = self.host
        if lead is not None:
            as_host = StagePlan(f"{lead.name}@host", "cpu", "cpu", lead.nodes)
            self.fallback = (
                Stage(pipeline, as_host, host_keep | set(leaving(pipeline, lead))),
                *self.host,
            )
        self.workers = workers or len(os.sched_getaffinity(0))
        self.out_refs = {name: str(ref) for name, ref in pipeline.outputs.items()}
        on_gpu = self.gpu.outputs if self.gpu else set()
        self.gpu_refs = {n: r for n, r in self.out_refs.items() if r in on_gpu}
        self.out_refs = {n: r for n, r in self.out_refs.items() if r not in on_gpu}
        specs = {k: s for k, s in pipeline.output_specs().items() if k in self.out_refs}
        # the static output each value key is written into in place (the first, when several
        # outputs name one value: the others are copied from it)
        self._in_place: dict[str, str] = {}
        for n, ref in self.out_refs.items():
            if specs[n].static:
                self._in_place.setdefault(ref, n)
        if lead is not None:
            # a batch holds its slot from the feeder to the consumer: room for every batch the
            # agent's receiver ring may hold, one being filled and one being read (3 slots in
            # all capped a DPU placement at 0.72-0.85x of the agent's own rate on the H200)
            slots = max(slots, ring_slots(plan, lead) + 2)
        # host assist (the plan's, `planner.assist`): while the agent is busy, a share of each
        # batch's rows runs the DPU stage here instead, as much as the host keeps up with
        share = host_share(plan, lead) if lead is not None else 0.0
        self.assist = HostAssist(share, self.batch_size) if share else None
        if self.assist is not None:
            slots += self.assist.extra_slots
        # batches in the GPU stage still hold their slot: room for them too
        self._ring = SlotRing(specs, self.batch_size, slots * (2 if self.gpu else 1))
        self._calls = 0  # the streams run so far
        # a plan that is one GPU stage, every output its own: batches go to it whole (gpu_direct)
        self.direct = None
        if self.gpu is not None and lead is None and not stages and not self.out_refs:
            self.direct = GpuDirect(self.gpu, self.gpu_refs, self.batch_size, self.max_wait_s)
        # serving's batch policy (`serve` sets it): a batch is closed as soon as no item waits
        # behind it and nothing is in flight downstream (no agent, or the agent idle), rather
        # than after the max wait; under load, batches still fill while the agent works
        self.close_when_idle = False
        self.failed_over: str | None = None  # why the DPU stage's items went to the host
        self._failover: tuple[str, bool] | None = None  # (failed_over, the agent's end)
        self.taken_back = 0  # how many items ran the DPU stage here instead

    @property
    def assisted(self) -> int:
        """How many items of the last call ran the DPU stage here by host assist."""
        return self.assist.taken if self.assist is not None else 0

    def begin_call(self) -> None:
        """A new call of a session: its failover, stage and transfer figures start afresh."""
        self.failed_over, self._failover, self.taken_back = None, None, 0
        for stage in {*self.host, *self.fallback}:  # their figures are the call's own
            stage.begin_call()
        if self.gpu is not None:
            self.gpu.begin_call()
        if self.front is not None:
            self.front.begin_call()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # the slots are plain memory; the front belongs to whoever made it
        if self.gpu is not None:
            self.gpu.close()

    def _process(self, task: _Task) -> None:
        """Run one item through its route into its batch's rows, stamping each row written.

        An output that no stage of the route computed in place (it came from the DPU agent, or
        from a stage without a destination for it) is copied into its row from the values."""
        slot, row = task.batch.slot, task.row
        dests = {ref: slot.arrays[n][row] for ref, n in self._in_place.items()}
        if self.gpu is not None and task.batch.gpu is not None:
            dests.update(self.gpu.dests(task.batch.gpu, row))
        values = dict(task.values)
        written: set[str] = set()
        for stage in task.route:
            written.update(stage.process(values, dests))
        for name, ref in self.out_refs.items():
            if ref not in values:
                continue  # left unstamped: the row fails as unwritten, never comes out as ok
            if name in slot.arrays:
                if ref not in written or self._in_place.get(ref) != name:
                    slot.arrays[name][row] = values[ref]
            else:
                slot.ragged[name][row] = np.array(values[ref], copy=True)
            slot.stamps.wrote(name, row, task.batch.key + task.index)
        if self.gpu is not None and task.batch.gpu is not None:
            self.gpu.collect(task.batch.gpu, row, values, written, task.batch.key + task.index)

    def stream(self, items: Iterable[Item]) -> Iterator[Batch]:
        """Process `items`; yield finished batches in order. A worker's crash is re-raised here."""
        if self.direct is not None:
            self._calls += 1
            yield from self.direct.stream(items, self._calls << 32)
            return
        room = self.assist.room if self.assist else 0  # the assisted rows, beside the bound
        work: queue.Queue[Any] = queue.Queue(maxsize=self.workers * 4 + room)
        source: queue.Queue[Any] = queue.Queue(maxsize=self.batch_size * 2)
        ready: dict[int, _Open] = {}
        cond = threading.Condition()
        failure: list[BaseException] = []
        theirs: list[BaseException] = []  # raised by the items iterator
        total: list[int] = []  # the number of batches, once the feeder has seen the end
        admitted = threading.Event()  # the feeder has admitted every item
        stop = threading.Event()
        front = self.front
        held: list[_Task] = []  # the open batch's items, for the agent
        placed = delivers_outputs(front, self.host, self.gpu, self.out_refs)
        # A call starts with every slot free (an abandoned call's batches held some), and
        # stamps rows with keys of its own: a straggler of an earlier call cannot pass for one
        # of this call's items.
        self._calls += 1
        self._ring.reset()
        if self.assist is not None:
            self.assist.begin_call()
        key = self._calls << 32

        def fail(exc: BaseException) -> None:
            with cond:
                failure.append(exc)
                cond.notify_all()
            stop.set()

        def finish(b: _Open, n: int = 1, rows: Iterable[int] = ()) -> None:
            now = time.perf_counter()
            with cond:
                for r in rows:
                    b.finished[r] = now
                b.pending -= n
                if b.pending == 0:
                    b.done_at = time.perf_counter()
                    ready[b.index] = b
                    cond.notify_all()

        def failed(task: _Task, reason: str, detail: str) -> None:
            with cond:
                task.batch.failures.append(ItemFailure(task.index, task.name, reason, detail))

        def worker() -> None:
            while (task := work.get()) is not _END:
                try:
                    self._process(task)
                except ItemError as exc:
                    failed(task, exc.reason, exc.detail)
                except BaseException as exc:  # carried to the consumer
                    fail(exc)
                finally:
                    if task.release:
                        task.release()
                    if task.assisted and self.assist:
                        self.assist.done()
                finish(task.batch, rows=(task.row,))

        def on_rows(tasks: list[_Task], rows: list[int], tensors, bad, release) -> None:
            assert front is not None  # a delivery's failed rows, then its ok ones
            now = time.perf_counter()
            for task in tasks:
                task.batch.delivered[task.row] = now
            bad, rerun = split_rerun(bad)
            for task, why in bad:
                failed(task, *why)
                finish(task.batch, rows=(task.row,))
            if rerun:
                on_host(rerun, RERUN_WHY)
            if placed and tasks:  # the delivered rows are the outputs: placed a batch at once
                for b, n in place_rows(tasks, rows, tensors, self.out_refs):
                    finish(b, n, [t.row for t in tasks if t.batch is b])
                release(len(tasks))
                return
            for task, row in zip(tasks, rows, strict=True):
                # the host stages read the DPU stage's outputs and the pipeline inputs it did
                # not take (a text branch beside an image branch)
                task.values = task.values | front.row_values(tensors, row)
                task.route, task.release = self.host, release
                if not put_unless(work, task, stop):
                    release()

        def on_host(tasks: list[_Task], why: str) -> None:
            """Run `tasks`' DPU stage here instead: the agent died, drains, or skipped them."""
            self._failover = failover_reason(self._failover, why, front)
            self.failed_over = self._failover[0]
            self.taken_back += len(tasks)
            for task in tasks:
                task.route = self.fallback
                put_unless(work, task, stop)

        def take_back(why: str) -> None:
            assert front is not None
            on_host(front.take_back(why), why)

        def receiver() -> None:
            assert front is not None
            try:
                front.receive(
                    lambda: stop.is_set() or (admitted.is_set() and not front.pending),
                    on_rows,
                    take_back,
                    on_host,
                )
            except BaseException as exc:
                fail(exc)

        def reader() -> None:
            try:
                for it in items:
                    if not put_unless(source, it, stop):
                        return
            except BaseException as exc:
                theirs.append(exc)  # the caller's own iterator: re-raised as it is
                fail(exc)
            put_unless(source, _END, stop)

        def route(task: _Task) -> None:
            if front is not None:  # the batch goes to the agent whole, once it is closed
                held.append(task)
                return
            task.route = self.fallback
            put_unless(work, task, stop)

        def share_out(tasks: list[_Task]) -> list[_Task]:
            """Host assist: the rows of the batch the host runs the DPU stage for go to its
            workers (`runtime.assist`); returns the rows for the agent."""
            assert front is not None
            if self.assist is None:
                return tasks
            k = self.assist.take(len(tasks), len(front.pending), work.qsize(), self.workers)
            if not k:
                return tasks
            for task in tasks[len(tasks) - k :]:
                task.route, task.assisted = self.fallback, True
                put_unless(work, task, stop)
            return tasks[: len(tasks) - k]

        def close(b: _Open) -> None:
            b.closed_at = time.perf_counter()
            if held and front is not None:  # one REQUEST frame (one credit) for the batch
                tasks, held[:] = held[:], []
                if not front.accepting:
                    on_host(tasks, front.dead or front.refusing or "the agent is gone")
                elif tasks := share_out(tasks):
                    try:
                        front.submit_batch(tasks)
                    except AgentError as exc:
                        # includes these tasks, recorded before the submit
                        take_back(front.why_ended(str(exc)))
            finish(b)

        def feeder() -> None:
            try:
                feed()
            except BaseException as exc:  # the call fails with it: never a feeder gone silent
                fail(exc)

        def feed() -> None:
            index = batch_no = 0
            current: _Open | None = None
            while not stop.is_set():
                # never an unbounded wait: a reader that stopped (the call abandoned, the
                # caller's iterator raised) puts no end marker, and `stop` must be seen
                timeout = POLL_S
                if current is not None:
                    timeout = max(0.0, current.admitted[0] + self.max_wait_s - time.perf_counter())
                try:
                    it = source.get(timeout=timeout)
                except queue.Empty:
                    if current is not None:
                        close(current)  # max_wait passed: ship the partial batch
                        current = None
                    continue
                if it is _END:
                    break
                if current is None:
                    slot = self._take_slot(stop)
                    if slot is None:
                        break
                    current = _Open(slot, batch_no, index, key=key)
                    if self.gpu is not None:
                        current.gpu = self.gpu.rows(self.batch_size)
                    batch_no += 1
                name, values = it
                row = len(current.names)
                with cond:
                    current.names.append(name)
                    current.admitted.append(time.perf_counter())
                    current.pending += 1
                route(_Task(current, row, index, name, values))
                index += 1
                if len(current.names) == self.batch_size or (
                    self.close_when_idle and source.empty() and (front is None or not front.pending)
                ):
                    close(current)
                    current = None
            if current is not None:
                close(current)
            admitted.set()
            with cond:
                total.append(batch_no)
                cond.notify_all()

        threads = [
            threading.Thread(target=worker, name=f"nicoffload-worker-{i}", daemon=True)
            for i in range(self.workers)
        ]
        threads += [
            threading.Thread(target=reader, name="nicoffload-reader", daemon=True),
            threading.Thread(target=feeder, name="nicoffload-feeder", daemon=True),
        ]
        if front is not None:
            threads.append(
                threading.Thread(target=receiver, name="nicoffload-receiver", daemon=True)
            )
        for t in threads:
            t.start()

        def ordered() -> Iterator[_Open]:
            """Batches whose host work is done, in order (on the GPU stage's feeding thread
            when there is one: it returns once the consumer has stopped)."""
            next_index = 0
            while True:
                with cond:
                    while not (
                        next_index in ready or failure or (total and next_index >= total[0])
                    ):
                        if stop.is_set():
                            return
                        cond.wait(timeout=0.1)
                    if failure and failure[0] in theirs:
                        raise failure[0]
                    if failure:
                        raise SystemFailure(
                            f"runtime: a worker failed: {failure[0]!r}"
                        ) from failure[0]
                    if next_index not in ready:
                        return
                    b = ready.pop(next_index)
                next_index += 1
                self._settle(b)
                yield b

        def to_gpu() -> Iterator[Mapping[str, Any]]:
            assert self.gpu is not None
            for b in ordered():
                fed.append(b)
                assert b.gpu is not None
                yield self.gpu.batch_inputs(b.gpu, len(b.names), b.ok)

        fed: deque[_Open] = deque()
        gpu_run: Any = None
        try:
            if self.gpu is None:
                for b in ordered():
                    yield self._to_batch(b)
                    b.check_slot("while the consumer read it")
                    self._ring.give(b.slot)
            else:
                gpu_run = self.gpu.run(to_gpu())
                for gb in gpu_run:
                    b = fed.popleft()
                    yield self._gpu_batch(b, gb)
                    b.check_slot("while the consumer read it")
                    self._ring.give(b.slot)
        finally:
            stop.set()
            if gpu_run is not None:
                gpu_run.close()  # joins the GPU stage's threads
            admitted.set()
            self._end_call(threads, work, source)

    def _take_slot(self, stop: threading.Event) -> BatchSlot | None:
        while not stop.is_set():
            try:
                return self._ring.take(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _end_call(self, threads: list[threading.Thread], work: queue.Queue, source: queue.Queue):
        """After a call, finished or abandoned: its threads end (they see `stop`), the work it
        queued is dropped with the receiver slots it holds given back, and the agent's items
        still pending are forgotten (a late result for one is then ignored)."""
        for q in (work, source):
            while True:
                try:
                    task = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(task, _Task) and task.release:
                    task.release()
        for _ in range(self.workers):
            try:
                work.put_nowait(_END)
            except queue.Full:
                break
        for t in threads:
            if t.name != "nicoffload-reader":  # it may wait inside the caller's iterator
                t.join(timeout=5.0)
        if self.front is not None:
            self.front.forget()

    @staticmethod
    def _settle(b: _Open) -> None:
        """Decide the batch's ok rows once its host work is done: a row that did not fail but
        was not written into every sink by its own item fails as unwritten (`batch.settle`)."""
        b.check_slot("before its rows were settled")
        stamps = [b.slot.stamps] + ([b.gpu.stamps] if b.gpu is not None else [])
        b.ok, b.failures = settle(b.start, b.names, b.failures, stamps, b.key)

    def _gpu_batch(self, b: _Open, gb: Any) -> Batch:
        """A batch after its GPU stage: the GPU's per-item failures join the host's."""
        assert self.gpu is not None
        batch = self._to_batch(b)
        more = [
            ItemFailure(b.start + row, b.names[row], e.reason, e.detail)
            for row, e in sorted(gb.failures.items())
            if batch.ok[row]
        ]
        ok = batch.ok.copy()
        ok[[f.index - b.start for f in more]] = False
        outputs = batch.outputs | self.gpu.outputs_of(gb, ok, self.gpu_refs)
        failures = sorted(batch.failures + more, key=lambda f: f.index)
        lat = time.perf_counter() - np.array(b.admitted)
        return replace(batch, outputs=outputs, ok=ok, failures=failures, latencies_s=lat)

    def _to_batch(self, b: _Open) -> Batch:
        n = len(b.names)
        ok = b.ok
        assert ok is not None  # settled in `ordered`
        # a failed row never carries a partial or stale result (from an earlier batch)
        for a in b.slot.arrays.values():
            a[:n][~ok] = 0
        for rows in b.slot.ragged.values():
            for r in np.flatnonzero(~ok).tolist():
                rows[r] = None
        outputs: dict[str, Any] = {k: a[:n] for k, a in b.slot.arrays.items()}
        outputs.update({k: list(v[:n]) for k, v in b.slot.ragged.items()})
        lat = b.done_at - np.array(b.admitted)
        return Batch(
            b.index, b.start, list(b.names), outputs, ok, list(b.failures), lat, self._times(b)
        )

    @staticmethod
    def _times(b: _Open) -> dict[str, np.ndarray]:
        """The batch's per-row stamps (perf_counter s; 0 where a row has none: `delivered`
        for a row that never went to the agent, or ran on the host after a failover)."""
        n = len(b.names)
        delivered, finished = np.zeros(n), np.zeros(n)
        for r, t in b.delivered.items():
            delivered[r] = t
        for r, t in b.finished.items():
            finished[r] = t
        return {
            "admitted": np.array(b.admitted),
            "closed": np.full(n, b.closed_at),
            "delivered": delivered,
            "finished": finished,
            "done": np.full(n, b.done_at),
        }

    def step_times(self) -> list[tuple[StagePlan, dict[str, StepTime]]]:
        """What each host stage's steps cost per item (see `StepTime`); the host's copy of a
        DPU stage is listed only once it has run items taken back from the agent."""
        stages = list(self.host)
        if self.fallback is not self.host:
            stages.insert(0, self.fallback[0])
        out = []
        for stage in stages:
            times = stage.times()
            if stage in self.host or any(t.calls for t in times.values()):
                out.append((stage.plan, times))
        return out
