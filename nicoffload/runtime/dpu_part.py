"""A DPU stage of the general path (`runtime.chain`): each batch's live rows go to its agent as
one REQUEST frame (`RemoteFront.submit_batch`), with the values of earlier stages its nodes
read, and the delivered rows come back into the batch. Rows the agent does not run (it died,
drains, skipped them, or a batch did not fit) run on the host instead, counted in
`taken_back`; a batch goes on once every row of it is settled, batches in order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nicoffload.errors import AgentError
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import RING_SLOTS, leaving, spec_of_key
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.buffers import put_unless
from nicoffload.runtime.parts import Control, HostPart
from nicoffload.runtime.remote import (
    POLL_S,
    RERUN_WHY,
    RemoteFront,
    failover_reason,
    split_rerun,
)
from nicoffload.runtime.work import Work, stage_reads

_END = object()


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
        depth: int = RING_SLOTS,
    ) -> None:
        """`depth`: batches kept at the agent at once (its receiver ring's slots, the plan's)."""
        self.plan, self.front, self.depth = plan, front, depth
        self.makes = {k: spec_of_key(pipeline, k) for k in leaving(pipeline, plan)}
        # an item carries every pipeline input and the earlier stages' values the stage reads
        # (the client sends only what the loaded stage reads)
        self.sends = list(dict.fromkeys([*pipeline.inputs, *stage_reads(pipeline, plan.nodes)]))
        as_host = StagePlan(f"{plan.name}@host", "cpu", "cpu", plan.nodes)
        self.fallback = HostPart(pipeline, as_host, pool, workers)
        self.failed_over: str | None = None
        self._failover: tuple[str, bool] | None = None  # (failed_over, the agent's end)
        self.taken_back = 0

    def begin_call(self) -> None:
        self.failed_over, self._failover, self.taken_back = None, None, 0
        self.front.begin_call()
        self.fallback.begin_call()

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        """Submit batches as they come (at most `depth` at the agent) on a thread of its own,
        receive on another, and yield each batch once it is settled, in order."""
        flight = _Flight(self, ctl)
        inflight: queue.Queue[Any] = queue.Queue(maxsize=self.depth)

        def submit() -> None:
            try:
                for w in works:
                    flight.submit(w)
                    if not put_unless(inflight, w, ctl.stop):
                        return
            except BaseException as exc:
                ctl.fail(exc)
            finally:
                flight.ended.set()
                put_unless(inflight, _END, ctl.stop)

        receiver = threading.Thread(target=flight.receive, name="nicoffload-receiver", daemon=True)
        submitter = threading.Thread(target=submit, name="nicoffload-submit", daemon=True)
        receiver.start()
        submitter.start()
        try:
            while not ctl.stop.is_set():
                try:
                    w = inflight.get(timeout=0.1)
                except queue.Empty:
                    continue
                if w is _END or not flight.wait(w, receiver):
                    return
                yield w
        finally:
            flight.ended.set()
            submitter.join(timeout=5.0)
            receiver.join(timeout=5.0)


class _Flight:
    """One call of a DPU stage: how many rows of each batch are not settled yet, and what the
    front calls back with (delivered rows, rows for the host, the agent's death)."""

    def __init__(self, part: DpuPart, ctl: Control) -> None:
        self.part, self.front, self.ctl = part, part.front, ctl
        self.cond = threading.Condition()
        self.left: dict[int, int] = {}  # by id(work)
        self.ended = threading.Event()  # every batch of the call is submitted

    def submit(self, w: Work) -> None:
        """The batch's live rows to the agent as one REQUEST frame (to the host when the agent
        takes no more)."""
        front = self.front
        w.room(self.part.makes)
        tasks = []
        for row in w.live():
            values = w.row_values(row, self.part.sends)
            if values is not None:
                tasks.append(_Task(w, row, values))
        with self.cond:
            self.left[id(w)] = len(tasks)
        if not tasks:
            return
        if front.accepting:
            try:
                front.submit_batch(tasks)
            except AgentError as exc:
                # includes these tasks, recorded before the submit
                self.take_back(front.why_ended(str(exc)))
        else:
            self.on_host(tasks, front.dead or front.refusing or "the agent is gone")

    def wait(self, w: Work, receiver: threading.Thread) -> bool:
        """Until every row of `w` is settled (False: the call stopped first)."""
        with self.cond:
            while self.left[id(w)] > 0 and not self.ctl.stop.is_set():
                if not receiver.is_alive() and self.front.pending:
                    # rows submitted after the receiver ended (the agent had just died)
                    self.cond.release()
                    try:
                        self.take_back(self.front.dead or "the agent's receiver has ended")
                    finally:
                        self.cond.acquire()
                    continue
                self.cond.wait(POLL_S)
            del self.left[id(w)]
        return not self.ctl.stop.is_set()

    def settled(self, w: Work, n: int = 1) -> None:
        with self.cond:
            if id(w) in self.left:  # else the call stopped before the batch was settled
                self.left[id(w)] -= n
            self.cond.notify_all()

    def receive(self) -> None:
        """The front's receiving loop, until the call stops or every row came back."""
        front = self.front
        try:
            front.receive(
                lambda: self.ctl.stop.is_set() or (self.ended.is_set() and not front.pending),
                self.on_rows,
                self.take_back,
                self.on_host,
            )
        except BaseException as exc:
            self.ctl.fail(exc)

    def on_rows(self, tasks, rows, tensors, bad, release) -> None:
        """A delivery: its failed rows fail, its ok rows' values are copied into their batches
        (the slot is then given back)."""
        bad, rerun = split_rerun(bad)
        for task, why in bad:
            task.work.fail(task.row, *why)
            self.settled(task.work)
        if rerun:
            self.on_host(rerun, RERUN_WHY)
        for task, r in zip(tasks, rows, strict=True):
            for k, v in self.front.row_values(tensors, r).items():
                task.work.put(k, task.row, v)
        if tasks:
            release(len(tasks))
        for task in tasks:
            self.settled(task.work)

    def take_back(self, why: str) -> None:
        """The agent is gone: every row it still holds runs on the host."""
        self.on_host(self.front.take_back(why), why)

    def on_host(self, tasks: list[_Task], why: str) -> None:
        part = self.part
        part._failover = failover_reason(part._failover, why, self.front)
        part.failed_over = part._failover[0]
        part.taken_back += len(tasks)
        by_work: dict[int, tuple[Work, list[int]]] = {}
        for t in tasks:
            by_work.setdefault(id(t.work), (t.work, []))[1].append(t.row)
        for w, rows in by_work.values():
            for f, n in part.fallback.submit(w, rows):
                f.add_done_callback(lambda f, w=w, n=n: self._ran(f, w, n))

    def _ran(self, f: Future, w: Work, n: int) -> None:
        if f.exception() is not None:
            self.ctl.fail(f.exception())
        self.settled(w, n)
