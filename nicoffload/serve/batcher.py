"""The one long-lived call that serves every request: requests' items go into ONE
`Session.stream` through a blocking queue-iterator, so the runtime's own batching (its batch
size and max wait, from the plan) is the dynamic batching; nothing batches a second time.

Each item is named `<request number>/<element index>` (the number is the server's own: clients'
ids may repeat), which is how a finished batch's rows find their requests again. The optional
user model is called once per finished batch, on its ok rows. Everything here runs on plain
threads; `on_done` is called on the batcher's thread (the server hops back to its loop).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.runtime.batch import UNWRITTEN, Batch
from nicoffload.serve.kserve import RequestError

log = logging.getLogger("nicoffload.serve")
Model = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]
_STOP = object()

# an item's failure reason -> the HTTP status of its request: the client's data, except a
# runtime fault (500)
STATUS_OF_REASON = {UNWRITTEN: 500, "too_large": 413}


class QueueFull(Exception):
    """More items than --max-queue would be outstanding: HTTP 503, at once."""


@dataclass
class Outcome:
    """What a request gets: its outputs (rows = its items, in order), or a status and reason."""

    status: int
    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None
    timings: dict[str, int] = field(default_factory=dict)
    retry: bool = (
        False  # refused for now (the queue is full): HTTP Retry-After, gRPC RESOURCE_EXHAUSTED
    )
    decided: float = 0.0  # perf_counter when it was decided: where `timings` end
    # gives back what `outputs` points into (a front's shared-memory slot), once encoded
    release: Callable[[], None] | None = None


def refusal(exc: Exception) -> Outcome:
    """The Outcome of a request `submit` refused: a full queue is 503 with `retry`, one
    larger than the queue its status (413), an ended stream 503 not ready."""
    if isinstance(exc, QueueFull):
        return Outcome(503, error=str(exc), retry=True)
    if isinstance(exc, RequestError):
        return Outcome(exc.status, error=exc.message)
    return Outcome(503, error=f"server not ready: {exc}")


@dataclass
class Pending:
    items: list[dict[str, Any]]
    on_done: Callable[[Outcome], None]
    arrived: float  # perf_counter when the server began to receive it
    parsed: float  # ... when it was read, parsed and checked
    deadline: float | None = None  # perf_counter past which its items are not run
    forwarded: float = 0.0  # ... when the Session's process had it from a front (--fronts)
    # its on_done copies the outputs before it returns (into a front's slot), so they may be
    # views into the runtime's batch, valid only until the batcher's round ends
    copies_at_once: bool = False
    seq: int = 0
    left: int = 0  # items not yet out of the pipeline (or skipped)
    answered: bool = False
    handed: float = 0.0  # when its last item went to the runtime
    out: float = 0.0  # when the batch with its last item came out
    modelled: float = 0.0  # ... and when the model's call on that batch returned
    row: dict[str, float] = field(default_factory=dict)  # its last item's runtime stamps
    batches: int = 0
    rows: list[tuple[dict[str, np.ndarray], int] | None] = field(default_factory=list)
    failure: tuple[int, str] | None = None  # (status, reason) of its first failed item


class Batcher:
    """Feeds requests into one stream of `session` and answers each with an Outcome."""

    def __init__(self, session: Any, model: Model | None = None, max_queue: int = 256) -> None:
        self.session, self.model, self.max_queue = session, model, max_queue
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._seq = itertools.count(1)
        self.outstanding = 0  # items accepted and not yet out of the pipeline
        self.expired = 0  # items never run: their request's deadline had passed
        self.items_run = 0  # items handed to the runtime
        self.failure: BaseException | None = None  # what ended the stream, if not a stop
        self.failed_over: str | None = None  # why the DPU stages' items went to the host
        # called on the batcher's thread after each round of answers (a batch's, a deadline's):
        # where `serve --fronts` sends the answers it gathered, one write per front
        self.after_answers: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="nicoffload-serve", daemon=True)
        self.ended = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def submit(self, p: Pending) -> None:
        """Queue a request (QueueFull when its items would pass --max-queue; a request larger
        than --max-queue can never fit: 413)."""
        refused = self.submit_many([p])[0]
        if refused is not None:
            raise refused

    def submit_many(self, ps: list[Pending]) -> list[Exception | None]:
        """Queue requests in one step (one lock, one hand-off to the stream: a front's group),
        each judged as if submitted alone, in order: None where it was queued, else what
        `submit` would have raised (RequestError 413, QueueFull, RuntimeError)."""
        refused: list[Exception | None] = [None] * len(ps)
        queued = []
        for k, p in enumerate(ps):
            if len(p.items) > self.max_queue:
                refused[k] = RequestError(
                    f"{len(p.items)} items in one request, more than --max-queue {self.max_queue}",
                    413,
                )
        with self._lock:
            for k, p in enumerate(ps):
                if refused[k] is not None:
                    continue
                if self.failure is not None or self.ended.is_set():
                    refused[k] = RuntimeError("the serving stream has ended")
                    continue
                n = len(p.items)
                if self.outstanding + n > self.max_queue:
                    refused[k] = QueueFull(
                        f"server busy: {self.outstanding} items queued or running, at most "
                        f"{self.max_queue} (--max-queue); retry later"
                    )
                    continue
                self.outstanding += n
                p.seq, p.left, p.rows = next(self._seq), n, [None] * n
                self._pending[p.seq] = p
                queued.append(p)
        if queued:
            self._queue.put(queued)
        return refused

    def stop(self, timeout: float | None = None) -> None:
        """End the stream once the queued requests have gone in; wait for the thread."""
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The stream's items: blocks for the next request; a request past its deadline is
        answered 504 and its remaining items are not run."""
        while (group := self._queue.get()) is not _STOP:
            for p in group:
                for i, item in enumerate(p.items):
                    now = time.perf_counter()
                    if p.deadline is not None and now > p.deadline:
                        self._expire(p, i, now)
                        self._answered()
                        break
                    p.handed = now
                    self.items_run += 1  # this thread's alone (the stream's feeder)
                    yield f"{p.seq}/{i}", item

    def _expire(self, p: Pending, i: int, now: float) -> None:
        skipped = len(p.items) - i
        late_us = round((now - p.deadline) * 1e6) if p.deadline is not None else 0
        with self._lock:
            self.expired += skipped
        reason = (
            f"deadline exceeded {late_us} us before item {i} entered the pipeline; "
            f"{skipped} of {len(p.items)} items were not run"
        )
        self._answer(p, Outcome(504, error=reason, timings=self._timings(p, now), decided=now))
        self._settle_many([(p, skipped)])

    def _run(self) -> None:
        try:
            for batch in self.session.stream(self._items()):
                self._deliver(batch)
        except BaseException as exc:  # the stream failed: every waiting request is told
            log.exception("the serving stream failed")
            with self._lock:
                self.failure = exc
                waiting = list(self._pending.values())
            for p in waiting:
                self._answer(p, Outcome(500, error=f"the pipeline failed: {exc}"))
            self._answered()
        finally:
            self.ended.set()

    def _answered(self) -> None:
        for hook in self.after_answers:
            try:
                hook()
            except Exception:  # as a failing callback: it must not stop the stream
                log.exception("after answers: %s failed", hook)

    def _run_model(
        self, outs: dict[str, np.ndarray], n: int
    ) -> tuple[dict[str, np.ndarray], float]:
        t0 = time.perf_counter()
        got = self.model(outs) if self.model is not None else outs
        if not isinstance(got, Mapping):
            raise TypeError(f"the model returned {type(got).__name__}, not a dict of arrays")
        res = {str(k): np.asarray(v) for k, v in got.items()}
        for k, v in res.items():
            if v.ndim == 0 or len(v) != n:
                raise ValueError(f"the model's output '{k}' has shape {v.shape}, not {n} rows")
        return res, time.perf_counter() - t0

    def _deliver(self, batch: Batch) -> None:
        t_out = time.perf_counter()
        # items whose DPU stage ran on the host: said when the reason changes (a single item
        # too large for the transfer, then the agent's end: runtime.remote.failover_reason)
        why = getattr(self.session.executor, "failed_over", None)
        if why and why != self.failed_over:
            self.failed_over = why
            log.warning("failover: items of the DPU stages ran on the host: %s", why)
        # every output on the GPU: `numpy()` copies them to fresh host arrays, this batch's own
        own = bool(batch.outputs) and all(
            getattr(v, "is_cuda", False) for v in batch.outputs.values()
        )
        if any(hasattr(v, "is_cuda") for v in batch.outputs.values()):
            batch = batch.numpy()
        keys = [name.split("/") for name in batch.names]
        with self._lock:  # once a batch, not once a row
            found = [self._pending.get(int(seq)) for seq, _ in keys]
            here = Counter(p.seq for p in found if p is not None)
            # every request here ends in this batch and copies its outputs as it is answered
            # (a front's slot): they can be views into the batch's slot, which is only reused
            # once this round is over
            views = self.model is None and all(
                p.copies_at_once and p.left == here[p.seq] for p in found if p is not None
            )
        keep = np.flatnonzero(batch.ok)
        if (own or views) and len(keep) == len(batch.ok):  # no copy of 64 rows (19 MB for ResNet)
            outs = {k: np.asarray(v)[: len(keep)] for k, v in batch.outputs.items()}
        else:  # fancy indexing copies: the batch's arrays are views into a slot reused after this
            outs = {k: np.asarray(v)[keep] for k, v in batch.outputs.items()}
        model_error = None
        if self.model is not None and len(keep):
            try:
                outs, _ = self._run_model(outs, len(keep))
            except Exception as exc:  # this batch's requests fail; the server goes on
                log.exception("the model failed on a batch of %d items", len(keep))
                model_error = f"the model failed: {type(exc).__name__}: {exc}"
        pos = np.cumsum(batch.ok) - 1
        failed = {f.name: f for f in batch.failures}
        t_modelled = time.perf_counter()  # the rows copied out of the slot, the model run
        times = {k: v.tolist() for k, v in batch.row_times.items()}
        touched: dict[int, list[Any]] = {}  # seq -> [its Pending, its items here, last row]
        for row, (name, (_, i), p) in enumerate(zip(batch.names, keys, found, strict=True)):
            if p is None:
                continue
            t = touched.get(p.seq)
            if t is None:
                touched[p.seq] = [p, 1, row]
            else:
                t[1], t[2] = t[1] + 1, row
            if name in failed:
                f = failed[name]
                if p.failure is None:
                    status = STATUS_OF_REASON.get(f.reason, 400)
                    p.failure = (status, f"item {i}: {f.reason}: {f.detail}")
            elif model_error is not None:
                p.failure = p.failure or (500, model_error)
            else:
                p.rows[int(i)] = (outs, int(pos[row]))
        for p, _, last in touched.values():
            p.out, p.modelled = t_out, t_modelled
            p.row = {k: float(v[last]) for k, v in times.items()}
            p.batches += 1
        self._settle_many([(p, n) for p, n, _ in touched.values()])
        self._answered()

    def _settle_many(self, counts: list[tuple[Pending, int]]) -> None:
        """`n` of each request's items are out (or skipped); the last one answers it."""
        done = []
        with self._lock:
            for p, n in counts:
                p.left -= n
                self.outstanding -= n
                if p.left == 0:
                    del self._pending[p.seq]
                    done.append(p)
        for p in done:
            if not p.answered:
                self._finish(p)

    def _finish(self, p: Pending) -> None:
        """A request whose items are all out: its Outcome, from its rows or its failure."""
        if p.failure is not None:
            now = time.perf_counter()
            status, error = p.failure
            self._answer(
                p, Outcome(status, error=error, timings=self._timings(p, now), decided=now)
            )
            return
        rows = [r for r in p.rows if r is not None]
        # one row and no model: a view, `outs` being this batch's own copy (`_deliver`); a
        # model's outputs are copied, as it may return a buffer it reuses
        if len(rows) == 1 and self.model is None:
            outs, at = rows[0]
            outputs = {k: v[at : at + 1] for k, v in outs.items()}
        else:
            outputs = {k: np.stack([outs[k][at] for outs, at in rows]) for k in rows[0][0]}
        now = time.perf_counter()
        self._answer(p, Outcome(200, outputs, timings=self._timings(p, now), decided=now))

    def _timings(self, p: Pending, now: float) -> dict[str, int]:
        """The request's breakdown (us): consecutive intervals between measured stamps, each
        ending where the next begins, so that they sum to `server_us` (arrived -> now). The
        runtime's parts follow its last item's row (`Batch.row_times`): into the executor
        (`admit`: the feeder and a free slot), the batch's wait to be sent (`batch_wait`) and
        the agent's stages and transfers (`dpu`) when it went to the agent, the host stages
        and the wait for a worker (`host`), the rest of its batch (`batch`), earlier batches
        and the consumer (`order`). Without row stamps (the general executor) that span is
        `pipeline_us` whole."""

        def us(a: float, b: float) -> int:
            return max(0, round((b - a) * 1e6))

        marks: list[tuple[str, float]] = [("receive_us", p.parsed)]
        if p.forwarded:  # from a front process to this one (serve --fronts)
            marks.append(("forward_us", p.forwarded))
        if p.handed:
            marks.append(("queue_us", p.handed))
        r = p.row
        if p.out and r.get("finished") and r.get("done"):
            marks.append(("admit_us", r["admitted"]))
            if r.get("delivered"):
                marks += [("batch_wait_us", r["closed"]), ("dpu_us", r["delivered"])]
            marks += [("host_us", r["finished"]), ("batch_us", r["done"]), ("order_us", p.out)]
        elif p.out:
            marks.append(("pipeline_us", p.out))
        if p.out and self.model is not None:
            marks.append(("model_us", p.modelled))  # with copying its rows out of the slot
        if p.out:
            marks.append(("answer_us", now))  # its outputs gathered, handed to the endpoint
        t: dict[str, int] = {}
        at = p.arrived
        for name, end in marks:
            t[name] = us(at, end)
            at = max(at, end)
        if p.out:
            t["batches"] = p.batches
        t["server_us"] = us(p.arrived, now)
        return t

    def _answer(self, p: Pending, outcome: Outcome) -> None:
        if p.answered:
            return
        p.answered = True
        try:
            p.on_done(outcome)
        except Exception:  # a callback that fails must not stop the stream
            log.exception("answering request %d failed", p.seq)
