"""A loaded stage: requests admitted once each (by id), a REQUEST frame's items as one batch (single
items are batched here), run on the agent's worker pool, and every batch's outputs forwarded, in
order, to the next placement's receiver.

Backpressure runs back to the client: the receiver holds its slots -> `send` blocks -> the batch
ring is full -> the batcher stops -> requests queue -> their credits are not returned, and their
bytes are not given back to the client's memory budget (`budget.py`), so the connection stops
reading -> the client's `submit` blocks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpu_agents import budget, procs, sharedslots
from dpu_agents.config import AgentConfig
from dpu_agents.logs import log_event
from dpu_agents.metrics import Metrics
from dpu_agents.rowarena import RowArena
from dpu_agents.seen import SeenIds
from dpu_agents.sharedslots import aligned
from dpu_agents.stagebuild import Built
from nicoffload.errors import AgentError, ItemError, TransportError
from nicoffload.runtime.batch import SLOT_OVERFLOW, UNWRITTEN
from nicoffload.runtime.buffers import BatchSlot, SlotRing
from nicoffload.transport import Sender
from nicoffload.transport.shm import Segment

log = logging.getLogger("dpu_agents.session")
BATCHES_IN_FLIGHT = 3  # batch slots per session: one filling, one running, one being sent
_END = object()
_KEYS = itertools.count(1)  # a session's name in the worker processes


FAILED_DETAILS = 6_000  # bytes of per-id reasons and details in one batch's meta
DETAIL_CHARS = 500  # of one row's detail there
GROUP_CHARS = 64  # of a reason, and of the one detail of each reason in `failed_rows`


def failed_meta(ids: list[int], failed: dict[int, tuple[str, str]]) -> dict[str, Any]:
    """The failed rows of a batch as its meta carries them, well inside MAX_META whatever the
    batch size (4096 ids of 9 bytes take 37 kB): `failed` {request id: [reason, detail]} while
    they fit FAILED_DETAILS bytes, then `failed_rows` [[reason, detail, [row, ...]], ...], the
    other rows by their index in the batch (3 bytes each at most), grouped by reason with the
    first one's detail (`nicoffload.runtime.remote.failed_of` reads both)."""
    detailed: dict[int, list[str]] = {}
    grouped: dict[str, list[Any]] = {}
    used = 0
    for row in sorted(failed):
        reason, detail = failed[row][0][:GROUP_CHARS], failed[row][1][:DETAIL_CHARS]
        cost = len(reason.encode()) + len(detail.encode()) + 16  # at least its msgpack bytes
        if not grouped and used + cost <= FAILED_DETAILS:
            detailed[ids[row]] = [reason, detail]
            used += cost
        else:
            grouped.setdefault(reason, [reason, detail[:GROUP_CHARS], []])[2].append(row)
    meta: dict[str, Any] = {"failed": detailed}
    if grouped:
        meta["failed_rows"] = list(grouped.values())
    return meta


class WorkerPool:
    """`n` threads running the items of every session; the kernels release the GIL."""

    processes = False  # procs.ProcPool's are

    def __init__(self, n: int) -> None:
        self.n = n
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"agent-worker-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def depth(self) -> int:
        return self._tasks.qsize()

    def restarts(self) -> int:
        return 0  # threads are not restarted

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException:  # a task handles its own errors; this one is a bug
                log.exception("worker task failed")

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


@dataclass
class Item:
    request_id: int
    values: dict[str, Any] | None  # None: rejected at the ingress, `reject` says why
    reject: tuple[str, str] = ("", "")
    cost: tuple[int, int] = (0, 0)  # (queued, decode) bytes of the budget, given back once sent


@dataclass
class _Piece:
    """Items of one REQUEST frame, admitted together: the client formed them as a batch."""

    items: list[Item]
    last: bool  # the frame's last piece: its forwarding returns the frame's credit


@dataclass
class _Batch:
    slot: BatchSlot
    ids: list[int] = field(default_factory=list)
    credits: int = 0  # REQUEST frames whose last item this batch forwards
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)
    cost: tuple[int, int] = (0, 0)  # its items' budget, given back once it is forwarded
    pending: int = 1  # the batcher's own hold until every row is dispatched
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finish_rows(self, n: int = 1, failed: dict[int, tuple[str, str]] | None = None) -> None:
        """`n` rows are done (`failed` those of them that failed, by row): one lock a run."""
        with self.lock:
            if failed:
                self.failed.update(failed)
            self.pending -= n
            if self.pending == 0:
                self.done.set()


class _Rows:
    """A batch's rows to run, taken one at a time by as many pool tasks as there are workers
    (`next` on the shared iterator is atomic under the GIL): a hand-off per worker and batch,
    not per item, and the rows still spread over every worker as they free up."""

    __slots__ = ("batch", "left", "n")

    def __init__(self, batch: _Batch, rows: list[tuple[int, dict[str, Any]]]) -> None:
        self.batch, self.left, self.n = batch, iter(rows), len(rows)


class Session:
    """One loaded stage. `fresh` tells new request ids from repeats, `admit` takes a REQUEST
    frame's items (in pieces), `close` finishes them."""

    def __init__(
        self,
        built: Built,
        sender: Sender,
        pool: WorkerPool,
        metrics: Metrics,
        *,
        on_credit: Callable[[int], None],
        on_fatal: Callable[[BaseException], None],
        forward_timeout: float,
        dedup_window: int,
        account: budget.Account | None = None,
        source: list[Any] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`source` ([yaml, plan, stage, batch_max_size, batch_max_wait_ms]: what LOAD built
        `built` from) and `config` (the agent's, as a dict) build the stage in the pool's
        worker processes too, when it has them."""
        self.built, self.sender, self.pool, self.metrics = built, sender, pool, metrics
        self.name = built.stage.plan.name
        self._on_credit, self._on_fatal = on_credit, on_fatal
        self._forward_timeout, self._dedup_window = forward_timeout, dedup_window
        self.account = account
        self.slot_bytes = BATCHES_IN_FLIGHT * built.slot_bytes()
        if account is not None and not account.take(budget.BATCH, self.slot_bytes):
            b = account.budget
            raise AgentError(
                f"the stage's batch slots need {self.slot_bytes} bytes; the agent's batch_bytes "
                f"({b.total[budget.BATCH]}) has {b.total[budget.BATCH] - b.snapshot()['batch']} "
                "left: lower the batch size, or try when other sessions have closed"
            )
        self.decode_cost = budget.decode_costs(built)
        self.key = next(_KEYS)
        self._segment: Segment | None = None
        self._views: list[dict[str, Any]] = []
        self.in_processes = pool.processes
        try:
            self._ring = self._slots(source, config)
        except BaseException:
            if account is not None:
                account.release(budget.BATCH, self.slot_bytes)
            raise
        # per batch slot, where its rows' outputs of varying shape wait to be sent
        # (with worker processes, none: `rowarena`)
        ragged = not pool.processes and any(not s.static for s in built.out_specs.values())
        b = account.budget if account is not None else None
        most = b.arena_most if b is not None else AgentConfig.max_arena_bytes
        typical = built.batch_max_size * sum(
            aligned(s.typical_nbytes) for s in built.out_specs.values() if not s.static
        )
        self._row_arenas = [
            RowArena(b, most, typical) for _ in range(BATCHES_IN_FLIGHT if ragged else 0)
        ]
        self._ingress: queue.Queue[Any] = queue.Queue()
        self._formed: queue.Queue[Any] = queue.Queue()
        self._seen = SeenIds(dedup_window)
        self._cond = threading.Condition()
        self.admitted = self.forwarded = 0
        self._reading = 0  # REQUEST frames being read
        self.broken: BaseException | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._batcher, name=f"batcher {self.name}", daemon=True),
            threading.Thread(target=self._forwarder, name=f"forwarder {self.name}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _slots(self, source: list[Any] | None, config: dict[str, Any] | None) -> SlotRing:
        """The batch slots: in shared memory, and the stage built in every worker process,
        when the pool runs kernels in processes; else arrays of this process."""
        b = self.built
        if not self.in_processes:  # arrays of its own, dropped at close (see _free_slots)
            self._views = [
                {
                    k: np.zeros((b.batch_max_size, *s.shape), s.dtype)
                    for k, s in b.out_specs.items()
                    if s.static
                }
                for _ in range(BATCHES_IN_FLIGHT)
            ]
            return SlotRing(b.out_specs, b.batch_max_size, BATCHES_IN_FLIGHT, arrays=self._views)
        if source is None or config is None:
            raise AgentError("a pool of worker processes needs the stage's source and config")
        try:
            seg, layout = sharedslots.shared_slots(b.out_specs, b.batch_max_size, BATCHES_IN_FLIGHT)
        except TransportError as exc:  # /dev/shm too small: the LOAD is refused, saying so
            raise AgentError(f"the stage's batch slots: {exc}") from None
        try:
            assert seg.array is not None
            msg = ["load", self.key, source, config, [seg.name, seg.array.size], layout]
            self.pool.load(self.key, msg)
        except BaseException:
            seg.close()
            raise
        self._segment = seg
        self._views = sharedslots.slot_views(seg, layout)
        return SlotRing(b.out_specs, b.batch_max_size, BATCHES_IN_FLIGHT, arrays=self._views)

    # --- ingress ---------------------------------------------------------------------------

    def reading(self, n: int) -> None:
        """A REQUEST frame's payload is being read (+1), or its items are admitted (-1): a drain
        waits for them too (a frame half read when the drain began was not admitted yet)."""
        with self._cond:
            self._reading += n
            self._cond.notify_all()

    def fresh(self, first: int, n: int) -> list[bool]:
        """Which of the request ids first .. first+n-1 were not seen (each now is)."""
        with self._cond:
            if self._closed:
                return [False] * n
            return self._seen.add_range(first, n)

    def admit(self, items: list[Item], last: bool = True) -> bool:
        """Queue a piece of one REQUEST frame (items with values None fail with their
        `reject`), run as one batch when it fits the batch size; `last`: the frame's last
        piece, whose forwarding returns the frame's credit. False once closed. Each item's
        `cost` (queued, decode bytes) is given back to the account once it is forwarded."""
        with self._cond:
            if self._closed:
                return False
            self.admitted += len(items)
        self._ingress.put(_Piece(items, last))
        self.metrics.depth(f"ingress:{self.name}", self._ingress.qsize())
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every admitted request is forwarded (or dropped, once broken)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.forwarded >= self.admitted and not self._reading, timeout
            )

    def close(self, timeout: float) -> None:
        """Finish the admitted requests (up to `timeout` s), then say goodbye to the receiver."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._seen = SeenIds(1)  # nothing is admitted any more: its memory goes now
        self._ingress.put(_END)
        self._threads[0].join(timeout)
        self._threads[1].join(max(0.1, timeout))
        self.sender.close()  # also wakes a forwarder blocked on a full receiver
        for t in self._threads:
            t.join(5.0)
        self._free_slots()
        if self.account is not None:
            self.account.release(budget.BATCH, self.slot_bytes)

    def row_arena(self, slot: BatchSlot) -> RowArena:
        """Where the rows of `slot`'s batch put their outputs of varying shape."""
        return self._row_arenas[slot.index]

    @property
    def rows_fresh(self) -> int:
        """Rows whose outputs of varying shape did not fit their slot's arena (fresh arrays)."""
        return sum(a.fresh for a in self._row_arenas)

    def _free_slots(self) -> None:
        """The batch slots' memory goes now, as their budget is given back: a closed session
        sits in reference cycles until the garbage collector runs, and its slots with it (30
        sessions of 75 MB slots opened and closed held 577 MB, or 1 GB of /dev/shm, against a
        batch_bytes of 256 MiB)."""
        for arena in self._row_arenas:
            arena.close()
        if self._segment is not None:  # the workers forget the stage, then its slots go
            self.pool.drop(self.key)
            sharedslots.release(self._segment, self._views)
        for arrays in self._views:
            arrays.clear()  # the ring's slots hold these dicts: nothing else holds the arrays

    # --- batching and running --------------------------------------------------------------

    def _pieces(self) -> Any:
        """Batches of pieces, each at most batch_max_size items (a larger piece is cut): a
        piece of several items (the client's batch) runs as it came, alone or after the
        single items waiting before it; single items are batched for up to batch_max_wait."""
        b, carry = self.built, None
        while True:
            first = carry if carry is not None else self._ingress.get()
            carry = None
            if first is _END:
                return
            size = b.batch_max_size
            if len(first.items) > size:  # cut: the rest is the next batch's
                carry = _Piece(first.items[size:], first.last)
                first = _Piece(first.items[:size], False)
            pieces = [first]
            count = len(first.items)
            deadline = time.monotonic() + b.batch_max_wait_s
            while count < size and len(pieces[-1].items) == 1 and carry is None:
                try:
                    it = self._ingress.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if it is _END or count + len(it.items) > size:
                    carry = it
                    break
                pieces.append(it)
                count += len(it.items)
            yield pieces

    def _batcher(self) -> None:
        for pieces in self._pieces():
            items = [it for p in pieces for it in p.items]
            self.metrics.depth(f"ingress:{self.name}", self._ingress.qsize())
            batch = _Batch(self._ring.take())
            if self._row_arenas:
                self._row_arenas[batch.slot.index].reset()
            batch.ids = [it.request_id for it in items]
            batch.credits = sum(p.last for p in pieces)
            batch.cost = (sum(it.cost[0] for it in items), sum(it.cost[1] for it in items))
            batch.pending += len(items)
            self._formed.put(batch)
            failed: dict[int, tuple[str, str]] = {}
            rows: list[tuple[int, dict[str, Any]]] = []
            if self.broken is not None:
                failed = dict.fromkeys(range(len(items)), ("agent_failed", str(self.broken)))
            else:
                for row, it in enumerate(items):
                    if it.values is None:
                        failed[row] = it.reject
                    else:
                        rows.append((row, it.values))
            if failed:
                batch.finish_rows(len(failed), failed)
            if rows:
                job = _Rows(batch, rows)
                for _ in range(min(len(rows), self.pool.n)):
                    self.pool.submit(lambda job=job: self._run(job))
            self.metrics.depth("workers", self.pool.depth())
            batch.finish_rows()
        self._formed.put(_END)

    def _run(self, job: _Rows) -> None:
        """Run rows of the job's batch until none is left; the rows' stamps, the batch's
        count, the stage's step times and the metrics are updated once, at the end."""
        if self.in_processes:
            procs.run_rows(self, job)
            return
        stage = self.built.stage
        batch = job.batch
        slot = batch.slot
        arrays = list(slot.arrays.items())
        ragged = list(slot.ragged.items())
        arena = self.row_arena(slot) if ragged else None
        allocs = {k: arena.alloc for k, _ in ragged} if arena is not None else {}
        failed: dict[int, tuple[str, str]] = {}
        stamped: dict[str, list[int]] = {k: [] for k in slot.stamps.rows}
        seconds: list[float] = []
        tally = stage.tally()
        process, clock = stage.process, time.perf_counter
        for row, values in job.left:
            t0 = clock()
            try:
                written = process(values, {k: a[row] for k, a in arrays} | allocs, tally)
                for k, a in arrays:
                    if k in values:  # else unstamped: the row is sent as failed (`_send`)
                        if k not in written:
                            a[row] = values[k]
                        stamped[k].append(row)
                for k, out in ragged:
                    # in the slot's arena already (a kernel that allocates), or copied there
                    out[row] = values[k] if k in written else arena.put(values[k])
                    stamped[k].append(row)
            except ItemError as exc:
                failed[row] = (exc.reason, exc.detail)
            except Exception as exc:  # a kernel bug fails the item, never the agent
                detail = f"{type(exc).__name__}: {exc}"
                failed[row] = ("internal", detail)
                log_event(log, logging.ERROR, "item_failed", stage=self.name, error=detail)
            finally:
                values.clear()  # its inputs and decoded images go now, not with the batch
            seconds.append(clock() - t0)
        try:
            stage.add(tally)
            stamps = slot.stamps.rows
            for k, got in stamped.items():
                if got:
                    at = np.asarray(got)
                    stamps[k][at] = at + 1  # Stamps.wrote(k, row, row), for every row at once
            if seconds:
                self.metrics.items(self.name, seconds, len(failed))
            for reason, _ in failed.values():
                self.metrics.error(reason)
        finally:  # whatever happened, the rows are done: the forwarder must not wait for ever
            batch.finish_rows(len(seconds), failed)

    def _forwarder(self) -> None:
        while (batch := self._formed.get()) is not _END:
            batch.done.wait()
            n = len(batch.ids)
            if self.broken is None:
                try:
                    self._send(batch, n)
                except (TransportError, ValueError) as exc:
                    self.broken = exc
                    self.metrics.error("forward")
                    log_event(log, logging.ERROR, "forward_failed", stage=self.name, error=str(exc))
                    self._on_fatal(exc)
            self._ring.give(batch.slot)
            if self.account is not None:
                self.account.release(budget.QUEUED, batch.cost[0])
                self.account.release(budget.DECODE, batch.cost[1])
            with self._cond:
                self.forwarded += n
                self._cond.notify_all()
            if self.broken is None and batch.credits:
                self._on_credit(batch.credits)
            self.metrics.depth("workers", self.pool.depth())

    def _fit(self, batch: _Batch, n: int) -> None:
        """Rows whose outputs of varying size do not fit the receiver's slot beside the rest of
        the batch fail as SLOT_OVERFLOW, the largest first, until the batch fits: the host
        runs those items itself, and the stage goes on (one outsized image broke the session
        for every later item)."""
        slot, room = batch.slot, getattr(self.sender, "slot_bytes", None)
        if room is None or not slot.ragged:
            return

        fixed = sum(aligned(a[:n].nbytes) for a in slot.arrays.values())
        sizes = {
            row: sum(aligned(np.asarray(rows[row]).nbytes) for rows in slot.ragged.values())
            for row in range(n)
            if row not in batch.failed
        }
        total = fixed + sum(sizes.values())
        for row in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if total <= room:
                break
            batch.failed[row] = (
                SLOT_OVERFLOW,
                f"its outputs ({sizes[row]} bytes) do not fit the receiver's "
                f"{room}-byte slot beside its batch",
            )
            total -= sizes[row]

    def _send(self, batch: _Batch, n: int) -> None:
        slot = batch.slot
        for row, sinks in slot.stamps.missing(n, 0).items():
            if row not in batch.failed:  # a row no kernel wrote is never sent as a result
                batch.failed[row] = (UNWRITTEN, f"the agent wrote no {', '.join(sinks)}")
        self._fit(batch, n)
        ok = np.ones(n, bool)
        ok[list(batch.failed)] = False
        tensors: dict[str, np.ndarray] = {}
        for k, a in slot.arrays.items():
            a[:n][~ok] = 0  # a failed row never carries a partial or stale result
            tensors[k] = a[:n]
        for k, rows in slot.ragged.items():
            for row in range(n):
                if ok[row]:
                    tensors[f"{k}@{row}"] = rows[row]
                rows[row] = None
        # sent_ns lets a host on the same clock time the transfer (run --json "transfers")
        meta = {"request_ids": batch.ids, **failed_meta(batch.ids, batch.failed)}
        meta["sent_ns"] = time.time_ns()
        self.sender.send(
            tensors, request_id=batch.ids[0], batch_size=n, meta=meta, timeout=self._forward_timeout
        )
        self.metrics.batch(sum(t.nbytes for t in tensors.values()))
