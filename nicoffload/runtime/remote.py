"""RemoteFront: the leading DPU stage of a plan, run by a DPU agent.

Items are submitted to the agent's ingress (request ids 1, 2, ... over the front's life, so
across a session's calls); the agent writes the stage's outputs into a receiver this process
listens on. Every submitted item stays in `pending`
until its result is claimed, so when the agent dies the unclaimed items are handed back to run
on the host, and a late result for an item already taken back is ignored: exactly once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import leaving  # noqa: F401  (the executor imports it here)
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.runtime.batch import DRAINING, ON_HOST, SLOT_OVERFLOW, WORKER_LOST
from nicoffload.topology import Device
from nicoffload.transport import Delivery, Receiver

POLL_S = 0.25  # how often an idle receiver checks the agent's liveness
# on_rows(tasks, rows, tensors, failed, release): a delivery's ok rows (the tasks, their rows
# in `tensors`), its failed ones [(task, (reason, detail))], and `release(n)`, to be called
# once for each ok row when it has been used (the delivery's slot is then given back)
OnRows = Callable[[list[Any], list[int], Mapping[str, Any], list[Any], Callable[..., None]], None]


@dataclass
class TransferStats:
    batches: int = 0
    items: int = 0
    bytes: int = 0
    flight_ns: int = 0  # agent send -> host receipt, summed over batches (same-host clocks)
    timed: int = 0


@dataclass
class _Release:
    """Releases a delivery's slot once every row claimed from it has been processed."""

    receiver: Receiver
    delivery: Delivery
    left: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, n: int = 1) -> None:
        with self.lock:
            self.left -= n
            done = self.left == 0
        if done:
            self.receiver.release(self.delivery)


class RemoteFront:
    """Submit items to an agent and turn its deliveries back into host work.

    With a `landing` (the stage's outputs go straight to a GPU stage), deliveries are landed in
    GPU memory as they arrive and the rows handed on are CUDA tensors; `destination` says how
    (`gpudirect.Destination`: the NIC writing GPU memory, or a pinned host ring and a copy)."""

    def __init__(
        self,
        stage: StagePlan,
        client: Any,
        receiver: Receiver,
        keys: list[str],
        landing: Any = None,
        destination: Any = None,
    ) -> None:
        self.stage = stage
        self.client = client  # an AgentClient with the stage loaded, forwarding to `receiver`
        self.receiver = receiver
        self.landing = landing  # a GpuLanding over `receiver`, or None: rows stay in host memory
        self.destination = destination
        self.keys = keys  # the value keys the host needs from the stage
        self.pending: dict[int, Any] = {}  # by request id, in submission order
        self._next_rid = 1
        self.lock = threading.Lock()
        self.dead: str | None = None
        self.refusing: str | None = None  # why the agent takes no new items (it drains)
        self.transfer = TransferStats()
        self._kernels_before: dict[str, Any] = {}  # the agent's kernel figures as a call began

    @classmethod
    def gone(cls, stage: StagePlan, why: str) -> RemoteFront:
        """A front whose agent died before it served anything (while it started or loaded
        the stage): every item runs the stage on the host, and the run says why."""
        front = cls(stage, None, None, [])
        front.dead = why
        return front

    @property
    def alive(self) -> bool:
        return self.dead is None and self.client is not None and self.client.alive

    @property
    def accepting(self) -> bool:
        """New items may go to the agent (alive, and not draining)."""
        self._heed_drain()
        return self.alive and self.refusing is None

    def _heed_drain(self) -> None:
        """An agent that drains says so (an unsolicited DRAIN): it takes nothing new."""
        if self.refusing is None and self.client is not None and self.client.draining:
            self.refusing = f"the agent is draining: {self.client.draining}"

    def why_ended(self, why: str) -> str:
        """Why the agent's transfer ended: an agent that drains closes its control connection
        just before its transfer and says so there first (wait for it briefly), else `why`."""
        if self.client is not None and self.client.alive:
            self.client.wait_gone(0.5)
        self._heed_drain()
        return self.refusing or why

    def begin_call(self) -> None:
        """A new call of a session: its transfers are counted afresh (request ids go on), and
        its kernels' figures from what the agent has counted so far."""
        self.transfer = TransferStats()
        self._kernels_before = self._agent_kernels()

    def submit(self, task: Any) -> None:
        """`submit_batch` of one task."""
        self.submit_batch([task])

    def submit_batch(self, tasks: list[Any]) -> None:
        """Record then submit a batch as one (one REQUEST frame, one credit); AgentError
        leaves the tasks pending for `take_back`. Request ids increase over the front's life,
        across a session's calls (the agent refuses an id it has seen)."""
        with self.lock:
            first = self._next_rid
            for i, task in enumerate(tasks):
                task.rid = first + i
                self.pending[task.rid] = task
            self._next_rid += len(tasks)
        self.client.submit_batch(first, [t.values for t in tasks])

    def take_back(self, why: str) -> list[Any]:
        """The agent is gone: every unclaimed task, to be run on the host."""
        with self.lock:
            self.dead = self.dead or why
            tasks = [self.pending[i] for i in sorted(self.pending)]
            self.pending.clear()
        return tasks

    def forget(self) -> None:
        """A call ended (or was abandoned): its unclaimed items are dropped, and a result the
        agent still sends for one is ignored (its request id is no longer pending)."""
        with self.lock:
            self.pending.clear()

    def receive(
        self,
        finished: Callable[[], bool],
        on_rows: OnRows,
        on_death: Callable[[str], None],
        on_host: Callable[[list[Any], str], None],
    ) -> None:
        """Loop until `finished()`: claim each delivery's rows and hand them to `on_rows`;
        items the agent will not deliver (it refused them while draining, or skipped them) go
        to `on_host`, and every unclaimed one to `on_death` once the agent is gone."""
        while not finished():
            if not self.alive:
                on_death(self.dead or self.why_ended("the agent stopped answering"))
                return
            try:
                d = (self.landing or self.receiver).recv(timeout=POLL_S)
            except TransportError as exc:
                if " within " in str(exc):  # an idle poll, not a failure
                    continue
                on_death(self.why_ended(f"the agent's transfer failed: {exc}"))
                return
            if d is None:
                on_death(self.why_ended("the agent closed its transfer"))
                return
            self._take(d, on_rows, on_host)

    def _claim(self, ids: list[int]) -> tuple[list[int], list[Any], list[Any]]:
        """The delivered rows still pending (their rows, their tasks) and the items skipped."""
        rows, tasks, skipped = [], [], []
        pending = self.pending
        with self.lock:
            for row, rid in enumerate(ids):
                task = pending.pop(rid, None)
                if task is not None:  # None: a duplicate, or an item already taken back
                    rows.append(row)
                    tasks.append(task)
            # The agent forwards in the order it admits, and items are submitted in order on
            # one connection: a pending item older than the newest delivered one was skipped.
            last = max(ids, default=0)
            for rid in list(pending):
                if rid >= last:
                    break
                skipped.append(pending.pop(rid))
        return rows, tasks, skipped

    def _take(self, d: Any, on_rows: OnRows, on_host) -> None:
        """Claim a delivery's rows (a `Delivery`, or a `GpuDelivery` from the landing) as a
        batch: its ok rows go to `on_rows` at once, failed ones with their reason."""
        now = time.time_ns()
        t = self.transfer
        t.batches += 1
        t.bytes += sum(a.nbytes for a in d.tensors.values())
        if "sent_ns" in d.meta:
            t.flight_ns += max(0, now - int(d.meta["sent_ns"]))
            t.timed += 1
        failed = failed_of(d.meta)
        ids = d.meta["request_ids"]
        rows, tasks, skipped = self._claim(ids)
        if skipped:
            on_host(skipped, f"the agent skipped {len(skipped)} items without a result")
        t.items += len(tasks)
        ok_rows, ok_tasks, bad, back = rows, tasks, [], []
        if failed:
            ok_rows, ok_tasks = [], []
            for row, task in zip(rows, tasks, strict=True):
                why = failed.get(ids[row])
                if why is None:
                    ok_rows.append(row)
                    ok_tasks.append(task)
                elif why[0] in ON_HOST:
                    if why[0] == DRAINING:  # the agent is shutting down: it takes no more
                        self.refusing = self.refusing or f"the agent is draining: {why[1]}"
                    back.append((task, why))
                else:
                    bad.append((task, tuple(why)))
        if self.landing is not None:
            # the landing gives the slot back itself once its copy is done; the rows are views
            # of fresh device tensors, complete once the copy has finished
            release: Callable[..., None] = _nothing
            d.wait()
        else:
            release = _Release(self.receiver, d, len(ok_tasks))
            if not ok_tasks:
                self.receiver.release(d)
        for task, (reason, detail) in back:
            said = _BACK.get(reason, "the agent did not run it")
            on_host([task], self.refusing or f"{said}: {detail}")
        on_rows(ok_tasks, ok_rows, d.tensors, bad, release)

    def row_values(self, tensors: Mapping[str, Any], row: int) -> dict[str, Any]:
        """The values of one delivered row, by key (views of the delivery)."""
        return {k: tensors[k][row] if k in tensors else tensors[f"{k}@{row}"] for k in self.keys}

    def remote_stats(self) -> dict[str, Any]:
        """The agent's own measurement of the stage's kernels in this call (since
        `begin_call`): `cpu_ms_per_item`, `wall_ms_per_item`, `steps` (see
        dpu_agents.server), or {} once it is gone."""
        now = self._agent_kernels()
        return since(now, self._kernels_before) if now else {}

    def _agent_kernels(self) -> dict[str, Any]:
        """What the agent has counted of the stage's kernels over its session, or {}."""
        if not self.alive:
            return {}
        try:
            doc = self.client.stats()
        except AgentError:
            return {}
        if "own" in doc:  # this session's alone: `kernels` sum every session of the stage name
            return doc["own"]  # (another host's too), so a call's figures would count theirs
        return doc.get("kernels", {}).get(self.stage.name, {})


def since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The agent's kernel figures of the calls after `before` (both its cumulative means per
    step, with each step's `calls`): the means of those calls alone. An agent that does not
    count calls per step (older) gives its lifetime means, as it did."""
    steps, was = now.get("steps", {}), before.get("steps", {})
    if not steps or any("calls" not in v for v in steps.values()):
        return now
    out: dict[str, dict[str, float]] = {}
    other = now.get("session") != before.get("session")  # the agent's session was another
    for k, v in steps.items():
        b = {} if other else was.get(k, {})
        n0 = b.get("calls", 0) if b.get("calls", 0) <= v["calls"] else 0  # a new session: all
        n = v["calls"] - n0
        out[k] = {
            what: (v[what] * v["calls"] - b.get(what, 0.0) * n0) / n if n else 0.0
            for what in ("cpu_ms", "wall_ms")
        } | {"calls": n}
    return {
        "cpu_ms_per_item": sum(v["cpu_ms"] for v in out.values()),
        "wall_ms_per_item": sum(v["wall_ms"] for v in out.values()),
        "items": max((v["calls"] for v in out.values()), default=0),
        "steps": out,
    }


def _nothing(n: int = 1) -> None:
    return None


@contextlib.contextmanager
def open_front(
    pipeline: Pipeline,
    plan: Plan,
    stage: StagePlan,
    device: Device,
    *,
    transport: str = "tcp",
    token_file: str | Path | None = None,
    slots: int = 4,
    gpu: Any = None,
) -> Iterator[RemoteFront]:
    """Reach the agent of `device` (start one on loopback when the device is emulated), load the
    stage on it, and listen for what it forwards (`fronts.open_fronts` for one stage: see there,
    also for `gpu`). Everything is closed on the way out."""
    from nicoffload.runtime.fronts import Wanted, open_fronts

    want = Wanted(stage, device, transport, slots, gpu)
    with open_fronts(pipeline, plan, [want], token_file=token_file) as fronts:
        yield fronts[stage.name]


@contextlib.contextmanager
def cores_apart(taken: list[int]) -> Iterator[list[int]]:
    """Confine the calling thread, and the threads it starts from now on (the executor's), to
    the cores an emulated DPU's agent is not pinned to: the emulated DPU then really is a
    separate set of cores, as a DPU's Arm cores are, and host and agent do not preempt each
    other. The thread's previous affinity comes back on exit. Yields the host's cores."""
    if not hasattr(os, "sched_setaffinity"):
        yield []
        return
    before = os.sched_getaffinity(0)
    mine = sorted(before - set(taken))
    if not mine or not taken:  # nothing to keep apart (one core, or an unpinned agent)
        yield sorted(before)
        return
    os.sched_setaffinity(0, mine)
    try:
        yield mine
    finally:
        os.sched_setaffinity(0, before)


# Failures that depend on where the stage ran: an item the agent refuses as too large for its
# own memory budget (or that its client kept back, over the agent's request size) is run on the
# host, which may have room; what the host then refuses too fails as it does in an all-host run.
# Counted as the DPU stage's items taken back to the host, with this reason.
RERUN_ON_HOST = frozenset({"too_large"})
_BACK = {  # why the host runs a row the agent sent back (batch.ON_HOST)
    SLOT_OVERFLOW: "an item did not fit the transfer",
    WORKER_LOST: "the agent lost the worker process running it",
}
RERUN_WHY = "the agent refused items as too large for it"


def split_rerun(bad: list[tuple[Any, tuple[str, str]]]) -> tuple[list, list]:
    """A delivery's failed rows as (those that fail, tasks to run on the host instead)."""
    fail = [(t, why) for t, why in bad if why[0] not in RERUN_ON_HOST]
    return fail, [t for t, why in bad if why[0] in RERUN_ON_HOST]


def failed_of(meta: Mapping[str, Any]) -> dict[int, tuple[str, str]]:
    """A delivery's failed rows, by request id: its meta's `failed` {id: [reason, detail]}
    and `failed_rows` [[reason, detail, [row, ...]], ...], the rows (indexes into
    `request_ids`) that did not fit with a detail each (`dpu_agents.session.failed_meta`)."""
    ids = meta["request_ids"]
    failed = {int(k): (v[0], v[1]) for k, v in meta.get("failed", {}).items()}
    for reason, detail, rows in meta.get("failed_rows", ()):
        failed.update((ids[r], (reason, detail)) for r in rows if 0 <= r < len(ids))
    return failed


def failover_reason(
    said: tuple[str, bool] | None, why: str, front: RemoteFront | None
) -> tuple[str, bool]:
    """What a call reports as its failover, and whether it is the agent's end: the first
    reason any item's DPU stage ran on the host, unless the agent then stopped taking items
    (it died or drains), whose reason replaces an earlier one of single items (too large for
    the transfer, say), once."""
    gone = front is not None and not front.accepting
    if said is None or (gone and not said[1]):
        return why, gone
    return said
