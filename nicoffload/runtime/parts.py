"""The stages of the general path (`runtime.chain`), one class per device kind. Each turns the
batches it is given into the same batches, finished, in order (`run(works, ctl)`).

`HostPart` runs a batch's rows on the worker pool; `GpuPart` runs whole batches through a
`GpuStage` and copies the values a later host or DPU stage reads down to the host; `DpuPart`
submits a batch's rows to its agent (`RemoteFront.submit_batch`: one REQUEST frame) and takes
the delivered rows back, running on the host the rows the agent does not run (it died, drains,
or skipped them), counted in `taken_back`.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import AgentError, ItemError, SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import leaving, spec_of_key
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.batch import UNWRITTEN
from nicoffload.runtime.buffers import put_unless
from nicoffload.runtime.gpu_feed import placeholder
from nicoffload.runtime.gpu_feed import spec_of_key as value_spec
from nicoffload.runtime.remote import POLL_S, RemoteFront
from nicoffload.runtime.stage import Stage
from nicoffload.runtime.work import Work, stage_reads

DPU_DEPTH = 4  # batches a DPU stage keeps at its agent at once (the receiver ring's slots)
_END = object()


@dataclass
class Control:
    """One call's stop flag, and how a stage reports a failure that is not an item's."""

    stop: threading.Event
    fail: Callable[[BaseException], None]


class HostPart:
    """A host CPU stage: each live row through its bound kernels, on the worker pool."""

    def __init__(
        self, pipeline: Pipeline, plan: StagePlan, pool: ThreadPoolExecutor, workers: int
    ) -> None:
        keys = leaving(pipeline, plan)
        self.plan = plan
        self.stage = Stage(pipeline, plan, set(keys))
        self.reads = stage_reads(pipeline, plan.nodes)
        self.makes = {k: spec_of_key(pipeline, k) for k in keys}
        self.pool = pool
        self.chunks = 2 * max(1, workers)  # chunks per batch: the pool stays busy to its end

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        for w in works:
            for f, _ in self.submit(w, w.live()):
                f.result()  # an exception that is no item's is carried to the caller
            yield w

    def submit(self, w: Work, rows: list[int]) -> list[tuple[Future, int]]:
        """Run `rows` of `w` on the pool, in chunks: (future, rows in it) for each."""
        w.room(self.makes)
        size = max(1, -(-len(rows) // self.chunks))
        parts = [rows[i : i + size] for i in range(0, len(rows), size)]
        return [(self.pool.submit(self._rows, w, p), len(p)) for p in parts]

    def _rows(self, w: Work, rows: list[int]) -> None:
        for row in rows:
            values = w.row_values(row, self.reads)
            if values is None:
                continue
            dests = {k: w.arrays[k][row] for k in self.makes if k in w.arrays}
            try:
                self.stage.process(values, dests)
            except ItemError as exc:
                w.fail(row, exc.reason, exc.detail)
                continue
            for k in self.makes:
                if k in dests:
                    w.cols[k][row] = dests[k]  # written in place
                elif k in values:
                    w.put(k, row, values[k])


class GpuPart:
    """A GPU stage: whole batches through a `GpuStage` (or a stand-in with its interface).
    Its values stay on the GPU; those in `down` (read by a later host or DPU stage) are also
    copied to the host, once."""

    def __init__(
        self, pipeline: Pipeline, plan: StagePlan, stage: Any = None, down: set[str] = frozenset()
    ) -> None:
        self.keys = leaving(pipeline, plan)
        if stage is None:
            from nicoffload.runtime.gpu_stage import GpuStage

            stage = GpuStage(pipeline, plan, set(self.keys))
        self.plan, self.stage, self.down = plan, stage, set(down)
        self.specs = {k: value_spec(pipeline, k) for k in stage.inputs}

    def close(self) -> None:
        self.stage.close()

    def step_ms_per_item(self) -> dict[str, float]:
        return self.stage.step_ms_per_item()

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        fed: deque[Work] = deque()

        def batches() -> Iterator[Mapping[str, Any]]:
            for w in works:
                fed.append(w)
                yield self._inputs(w)

        run = self.stage.stream(batches())
        try:
            for gb in run:
                w = fed.popleft()
                self._take(w, gb)
                yield w
        finally:
            run.close()  # joins the stage's threads

    def _inputs(self, w: Work) -> dict[str, Any]:
        """The batch's `{input key: items}`: values made on the GPU as they are, host rows with
        a placeholder for each failed row."""
        out: dict[str, Any] = {}
        live = set(w.live())
        for k in self.stage.inputs:
            if k in w.dev:
                out[k] = w.dev[k]
                continue
            col = w.cols.get(k) or [None] * w.n
            rows = []
            for i, v in enumerate(col):
                if v is None and i in live:
                    w.fail(i, UNWRITTEN, f"no stage made '{k}' for this item (a runtime fault)")
                rows.append(v if v is not None and i in live else placeholder(self.specs[k]))
            out[k] = rows
        return out

    def _take(self, w: Work, gb: Any) -> None:
        if gb.n != w.n:
            raise SystemFailure(
                f"runtime: GPU stage '{self.plan.name}' returned {gb.n} rows for a batch of {w.n}"
            )
        for row, e in sorted(gb.failures.items()):
            w.fail(row, e.reason, e.detail)
        produced = getattr(gb, "produced", None)
        made = np.ones(w.n, bool) if produced is None else np.asarray(produced, bool)
        for k in self.keys:
            if k in gb.outputs:
                w.dev[k], w.made[k] = gb.outputs[k], made
        for k in self.down:
            if k in w.dev:
                rows = to_host(w.dev[k])
                w.cols[k] = [v if made[i] else None for i, v in enumerate(rows)]


def to_host(value: Any) -> list[Any]:
    """A GPU stage's batch value as host rows: a batch tensor copied down in one DMA into
    page-locked memory (rows are views of it), a list row by row (None stays None)."""
    if isinstance(value, list):
        return [None if v is None else _host_array(v) for v in value]
    if hasattr(value, "is_cuda"):
        import torch

        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value)
        return list(host.numpy())
    return list(np.asarray(value))


def _host_array(v: Any) -> np.ndarray:
    return v.cpu().numpy() if hasattr(v, "is_cuda") else np.asarray(v)


@dataclass
class _Task:
    """One row at the agent: what `RemoteFront` keeps of it (`values`, `rid`)."""

    work: Work
    row: int
    values: Mapping[str, Any]
    rid: int = 0


class DpuPart:
    """A DPU stage, run by its agent through `front`; rows the agent does not run are run by
    `fallback` (the stage's nodes bound on the host)."""

    def __init__(
        self,
        pipeline: Pipeline,
        plan: StagePlan,
        front: RemoteFront,
        pool: ThreadPoolExecutor,
        workers: int,
    ) -> None:
        self.plan, self.front = plan, front
        self.makes = {k: spec_of_key(pipeline, k) for k in leaving(pipeline, plan)}
        reads = stage_reads(pipeline, plan.nodes)
        # an agent takes every pipeline input of an item, and the values of earlier stages
        # its stage reads
        self.sends = list(dict.fromkeys([*pipeline.inputs, *reads]))
        as_host = StagePlan(f"{plan.name}@host", "cpu", "cpu", plan.nodes)
        self.fallback = HostPart(pipeline, as_host, pool, workers)
        self.failed_over: str | None = None
        self.taken_back = 0

    def begin_call(self) -> None:
        self.failed_over, self.taken_back = None, 0
        self.front.begin_call()

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        front = self.front
        cond = threading.Condition()
        left: dict[int, int] = {}  # rows of each batch not settled yet, by id(work)
        inflight: queue.Queue[Any] = queue.Queue(maxsize=DPU_DEPTH)
        ended = threading.Event()

        def settled(w: Work, n: int = 1) -> None:
            with cond:
                left[id(w)] -= n
                cond.notify_all()

        def on_host(tasks: list[_Task], why: str) -> None:
            self.failed_over = self.failed_over or why
            self.taken_back += len(tasks)
            by_work: dict[int, tuple[Work, list[int]]] = {}
            for t in tasks:
                by_work.setdefault(id(t.work), (t.work, []))[1].append(t.row)
            for w, rows in by_work.values():
                for f, n in self.fallback.submit(w, rows):
                    f.add_done_callback(lambda f, w=w, n=n: done(f, w, n))

        def done(f: Future, w: Work, n: int) -> None:
            if f.exception() is not None:
                ctl.fail(f.exception())
            settled(w, n)

        def on_rows(tasks, rows, tensors, bad, release) -> None:
            for task, why in bad:
                task.work.fail(task.row, *why)
                settled(task.work)
            for task, r in zip(tasks, rows, strict=True):
                for k, v in front.row_values(tensors, r).items():
                    task.work.put(k, task.row, v)  # copied: the slot is given back
            if tasks:
                release(len(tasks))
            for task in tasks:
                settled(task.work)

        def take_back(why: str) -> None:
            on_host(front.take_back(why), why)

        def receive() -> None:
            try:
                front.receive(
                    lambda: ctl.stop.is_set() or (ended.is_set() and not front.pending),
                    on_rows,
                    take_back,
                    on_host,
                )
            except BaseException as exc:
                ctl.fail(exc)

        def submit() -> None:
            try:
                for w in works:
                    self._submit(w, left, cond, on_host, take_back)
                    if not put_unless(inflight, w, ctl.stop):
                        return
            except BaseException as exc:
                ctl.fail(exc)
            finally:
                ended.set()
                put_unless(inflight, _END, ctl.stop)

        receiver = threading.Thread(target=receive, name="nicoffload-receiver", daemon=True)
        submitter = threading.Thread(target=submit, name="nicoffload-submit", daemon=True)
        receiver.start()
        submitter.start()
        try:
            while not ctl.stop.is_set():
                try:
                    w = inflight.get(timeout=0.1)
                except queue.Empty:
                    continue
                if w is _END:
                    return
                with cond:
                    while left[id(w)] > 0 and not ctl.stop.is_set():
                        if not receiver.is_alive() and front.pending:
                            # rows submitted after the receiver ended (the agent had just died)
                            cond.release()
                            try:
                                take_back(front.dead or "the agent's receiver has ended")
                            finally:
                                cond.acquire()
                            continue
                        cond.wait(POLL_S)
                    left.pop(id(w), None)
                if ctl.stop.is_set():
                    return
                yield w
        finally:
            ended.set()
            submitter.join(timeout=5.0)
            receiver.join(timeout=5.0)

    def _submit(self, w: Work, left, cond, on_host, take_back) -> None:
        """The batch's live rows to the agent as one REQUEST frame (to the host when the
        agent takes no more)."""
        front = self.front
        w.room(self.makes)
        tasks = []
        for row in w.live():
            values = w.row_values(row, self.sends)
            if values is not None:
                tasks.append(_Task(w, row, values))
        with cond:
            left[id(w)] = len(tasks)
        if not tasks:
            return
        if front.accepting:
            try:
                front.submit_batch(tasks)
            except AgentError as exc:
                take_back(str(exc))  # includes these tasks, recorded before the submit
        else:
            on_host(tasks, front.dead or front.refusing or "the agent is gone")
