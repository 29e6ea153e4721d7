"""The agent's kernels in worker processes, one per core (`processes` in the config): a pool with
the interface of `session.WorkerPool` whose threads each drive one process (`dpu_agents.worker`).

A session's batch slots are one shared-memory segment (`sharedslots`) that every worker maps;
a worker thread takes rows of a batch, copies their values into its process's input arena, sends
the rows' places in one message and gets back which rows failed and why, which outputs each
wrote, and the step times; outputs of varying shape come back through its output arena, which
the worker asks the agent to empty (`flush`) when the next one does not fit. The arenas
(`arenas.Arenas`) are bounded and counted in the agent's memory budget. The GIL is held only around
those messages: the kernels run in processes of their own.

A worker process that dies fails the rows it held (`agent_worker_lost`, with its exit status:
the host runs them itself) and is started again, the loaded stages built in it anew. Every
worker is started from one thread of the pool (`Spawner`) and dies with the agent (PDEATHSIG,
set by the worker), even while stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agents.arenas import IN, OUT, Arenas, WorkerGone
from dpu_agents.link import BYTES, TENSOR, TEXT, Link
from dpu_agents.logs import log_event
from dpu_agents.sharedslots import aligned
from nicoffload.errors import AgentError
from nicoffload.runtime.batch import SLOT_OVERFLOW, WORKER_LOST

if TYPE_CHECKING:
    pass

log = logging.getLogger("dpu_agents.procs")
READY_S = 120.0  # a new worker imports numpy, numba and the kernels (their cache on disk)
LOAD_S = 300.0  # a stage built in a worker: its kernels compiled, or read from numba's cache
_local = threading.local()


class Spawner:
    """Starts every worker process from one thread that lives as long as the pool: the
    PDEATHSIG a worker sets (`worker.die_with`) fires when the *thread* that forked it exits,
    and workers are also restarted from short-lived threads (a LOAD's)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="agent-spawner", daemon=True)
        self._thread.start()

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """`subprocess.Popen(args, **kwargs)`, run by the spawner's thread."""
        done: Future[subprocess.Popen[bytes]] = Future()
        with self._lock:
            if self._closed:
                raise WorkerGone("the pool is closed: no worker process is started")
            self._requests.put((args, kwargs, done))
        return done.result()

    def _serve(self) -> None:
        while (req := self._requests.get()) is not None:
            args, kwargs, done = req
            try:
                done.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as exc:  # the caller raises it
                done.set_exception(exc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._requests.put(None)
        self._thread.join()


class Proc:
    """The agent's side of one worker process, used by one thread at a time (`lock`)."""

    def __init__(
        self,
        index: int,
        loads: Callable[[], list[list[Any]]],
        run_s: float = 120.0,
        spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
    ) -> None:
        """`run_s`: how long a call on rows may take before the worker is taken as stuck
        (stopped, or in a kernel that does not return) and killed. `spawn`: Popen, or the
        pool's `Spawner.popen`."""
        self.index, self._loads, self.run_s, self._spawn = index, loads, run_s, spawn
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.link: Link | None = None
        self._ready = False
        self.arenas = Arenas()
        self.restarts = 0
        self.start()

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        try:
            self.proc = self._spawn(
                [sys.executable, "-m", "dpu_agents.worker", str(fd), str(os.getpid())],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "NUMBA_NUM_THREADS": "1"},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.link, self._ready = Link(ours), False

    def call(self, msg: list[Any]) -> list[Any]:
        """One message and its reply; WorkerGone if the process is not there to answer."""
        try:
            if self.link is None:
                self._restart()
            assert self.link is not None
            if not self._ready:
                self.link.sock.settimeout(READY_S)
                self._expect(self.link.recv(), "ready")
                self._ready = True
                self.link.sock.settimeout(None)
                for load in self._loads():  # a restarted worker builds what is loaded
                    if load is not msg:
                        self._expect(self._call(load), "ok")
            return self._call(msg)
        except (EOFError, OSError, WorkerGone) as exc:
            why = self._gone(exc)
            raise WorkerGone(why) from None

    def _call(self, msg: list[Any]) -> list[Any]:
        assert self.link is not None
        self.link.sock.settimeout(LOAD_S if msg[0] == "load" else self.run_s)
        self.link.send(msg)
        try:
            return self.link.recv()
        except TimeoutError:
            limit = self.link.sock.gettimeout()
            raise WorkerGone(f"no answer to {msg[0]} within {limit} s") from None

    @staticmethod
    def _expect(reply: list[Any], what: str) -> None:
        if reply[0] != what:
            raise WorkerGone(f"answered {reply[:2]!r}, not {what!r}")

    def _gone(self, exc: BaseException) -> str:
        proc = self.proc
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        why = f"the agent's worker process {proc.pid if proc else '?'} exited ({rc}): {exc}"
        log_event(log, logging.ERROR, "worker_gone", worker=self.index, error=why)
        self._drop_link()
        return why

    def abandon(self, why: str) -> None:
        """Kill the worker (its link may be in the middle of an exchange): it is started again
        on its next call."""
        if self.proc is not None and self.link is not None:
            self.proc.kill()
            self._gone(RuntimeError(why))

    def _restart(self) -> None:
        self.restarts += 1
        self.start()

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.sock.close()
        self.link = None

    def close(self, timeout: float) -> None:
        self._drop_link()  # the worker exits when its socket closes
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.arenas.close()


class ProcPool:
    """`n` worker processes, each driven by a thread of this process; tasks as WorkerPool's."""

    processes = True

    def __init__(self, n: int, run_s: float = 120.0) -> None:
        self.n, self.run_s = n, run_s
        self._loads: dict[int, list[Any]] = {}
        self._loads_lock = threading.Lock()
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.spawner = Spawner()
        self.procs: list[Proc] = []
        try:
            for i in range(n):
                self.procs.append(Proc(i, self.loads, run_s, self.spawner.popen))
        except BaseException:  # the ones started go again
            for p in self.procs:
                p.close(1.0)
            self.spawner.close()
            raise
        self._threads = [
            threading.Thread(
                target=self._work, args=(p,), name=f"agent-worker-{p.index}", daemon=True
            )
            for p in self.procs
        ]
        for t in self._threads:
            t.start()

    def loads(self) -> list[list[Any]]:
        with self._loads_lock:
            return list(self._loads.values())

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def depth(self) -> int:
        return self._tasks.qsize()

    def restarts(self) -> int:
        return sum(p.restarts for p in self.procs)

    def _work(self, proc: Proc) -> None:
        _local.proc = proc
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException:  # a task handles its own errors; this one is a bug
                log.exception("worker task failed")

    def load(self, key: int, msg: list[Any]) -> None:
        """Build a stage in every worker (in parallel). AgentError if a worker cannot build
        it, or if none is there to; a worker that dies, or is still silent `run_s` after the
        first has built it (stopped, stuck), is killed: it builds the stage again when it is
        restarted, on its next rows."""
        with self._loads_lock:
            self._loads[key] = msg
        errors: list[str] = []
        lost: list[str] = []
        built = threading.Event()

        def one(p: Proc) -> None:
            with p.lock:
                try:
                    reply = p.call(msg)
                except WorkerGone:  # found dead (it died while idle): once more, restarted
                    try:
                        reply = p.call(msg)
                    except WorkerGone as exc:
                        lost.append(str(exc))
                        return
            if reply[0] == "ok":
                built.set()
            else:
                errors.append(str(reply[1]))

        threads = {p: threading.Thread(target=one, args=(p,), daemon=True) for p in self.procs}
        for t in threads.values():
            t.start()
        while not built.wait(0.05) and any(t.is_alive() for t in threads.values()):
            pass
        deadline = time.monotonic() + self.run_s
        for p, t in threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive() and p.proc is not None:  # silent while the others built it
                p.proc.kill()
                t.join()
        if errors or len(lost) == len(self.procs):
            self.drop(key)
            why = errors[0] if errors else lost[0]
            raise AgentError(f"the stage could not be built in a worker process: {why}")

    def drop(self, key: int) -> None:
        with self._loads_lock:
            if self._loads.pop(key, None) is None:
                return
        for p in self.procs:
            with p.lock:
                if p.link is not None and p._ready:
                    with contextlib.suppress(WorkerGone):
                        p.call(["drop", key])

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join(timeout)
        for p in self.procs:
            p.close(timeout)
        self.spawner.close()


def current() -> Proc:
    """The worker process of the pool thread running this task."""
    return _local.proc


def run_rows(session: Any, job: Any) -> None:
    """`Session._run` with the kernels in this pool thread's worker process: rows taken a few at a
    time (so the batch still spreads over every worker), fewer when their inputs would not fit
    the input arena, their values copied into it, and one message each way per chunk (and a
    pair per flush of the output arena)."""
    proc = current()
    batch = job.batch
    chunk = max(1, -(-job.n // (2 * session.pool.n)))
    account = session.account  # its budget is the agent's one
    proc.arenas.use(account.budget if account is not None else None)
    rows: list[Any] = []
    while rows or (rows := list(itertools.islice(job.left, chunk))):
        failed: dict[int, tuple[str, str]] = {}
        run: list[Any] = []
        done = rows
        try:
            run, refused, rows = _fitting(proc.arenas, rows, failed)
            done = run + refused
            if run:
                _run_chunk(session, proc, batch.slot, run, failed)
        except WorkerGone as exc:  # shared memory has no room for the input arena
            rows = []
            failed.update((row, (SLOT_OVERFLOW, str(exc))) for row, _ in done)
        except Exception as exc:  # a bug here fails these rows; the job's other rows go on
            detail = f"{type(exc).__name__}: {exc}"
            failed.update((row, ("internal", detail)) for row, _ in done if row not in failed)
            log_event(log, logging.ERROR, "item_failed", stage=session.name, error=detail)
            if done is rows:  # _fitting raised: the whole chunk is done; else the rest goes on
                rows = []
        finally:
            for _, values in done:
                values.clear()
            for reason, _ in failed.values():
                session.metrics.error(reason)
            batch.finish_rows(len(done), failed)


def _fitting(arenas: Arenas, rows: list[Any], failed: dict) -> tuple[list, list, list]:
    """The first of `rows` whose inputs the input arena holds (grown if need be: halving the
    rows until they fit), none refused, and the rest; or, when the first row does not fit alone,
    that row refused (failed, for the host to run) and the rest."""
    sizes = [sum(aligned(_nbytes(v)) for v in values.values()) for _, values in rows]
    k = len(rows)
    while k and not arenas.fit(IN, sum(sizes[:k])):
        k //= 2
    if k:
        return rows[:k], [], rows[k:]
    failed[rows[0][0]] = (SLOT_OVERFLOW, arenas.why(IN, sizes[0]))
    return [], rows[:1], rows[1:]


def _nbytes(v: Any) -> int:
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, str):
        return len(_utf8(v))
    return memoryview(v).nbytes


def _utf8(text: str) -> bytes:
    """A text value's bytes for the worker: a lone surrogate (which the client sends, so that
    the stage fails that item as the host does: `bad_text`) goes through as itself, where plain
    utf-8 raised and the rows of its chunk were never finished (the host waited for ever)."""
    return text.encode("utf-8", "surrogatepass")


def _run_chunk(session: Any, proc: Proc, slot: Any, rows: list[Any], failed: dict) -> None:
    """Run the rows in the worker; those it did not answer for fail (agent_worker_lost: the host
    runs them), the others as it said."""
    finished: set[int] = set()
    try:
        with proc.lock:
            _chunk(session, proc, slot, rows, failed, finished)
    except WorkerGone as exc:
        failed.update((row, (WORKER_LOST, str(exc))) for row, _ in rows if row not in finished)
    except Exception as exc:  # a bug here fails the rows, never the session
        detail = f"{type(exc).__name__}: {exc}"
        failed.update((row, ("internal", detail)) for row, _ in rows if row not in finished)
        log_event(log, logging.ERROR, "item_failed", stage=session.name, error=detail)
        with proc.lock:
            proc.abandon(detail)


def _chunk(
    session: Any, proc: Proc, slot: Any, rows: list[Any], failed: dict, finished: set[int]
) -> None:
    """Copy the rows' values into the worker's input arena (`_fitting` sized it) and run them
    there; their outputs of varying shape are copied out of the output arena at each flush."""
    places, at = [], 0
    parts = []
    for row, values in rows:
        where = []
        for k, v in values.items():
            if isinstance(v, np.ndarray):
                a = np.ascontiguousarray(v)
                raw = a.reshape(-1).view(np.uint8)
                where.append([k, TENSOR, at, raw.size, a.dtype.str, list(a.shape)])
            elif isinstance(v, str):
                raw = np.frombuffer(_utf8(v), np.uint8)
                where.append([k, TEXT, at, raw.size, "|u1", [raw.size]])
            else:
                raw = np.frombuffer(v, np.uint8)
                where.append([k, BYTES, at, raw.size, "|u1", [raw.size]])
            parts.append((at, raw))
            at += aligned(raw.size)
        places.append([row, where])
    arenas = proc.arenas
    buf = arenas.array(IN)
    assert buf is not None and at <= buf.size
    for off, raw in parts:
        buf[off : off + raw.size] = raw
    try:
        msg = ["run", session.key, slot.index, arenas.where(IN), arenas.where(OUT)]
        reply = proc.call([*msg, arenas.keep, places])
        while reply[0] == "flush":  # the outputs so far out, and room for the next row's
            _results(slot, arenas.array(OUT), reply[1], failed, finished)
            reply = proc.call(_room(arenas, reply[2]))
        if reply[0] != "done":
            raise WorkerGone(str(reply[1]))
        _, results, seconds, cpu_ns, wall_ns, calls = reply
        _results(slot, arenas.array(OUT), results, failed, finished)
    finally:
        arenas.trim()
    stage = session.built.stage
    tally = stage.tally()
    tally.cpu_ns, tally.wall_ns, tally.calls = cpu_ns, wall_ns, calls
    stage.add(tally)
    if seconds:
        session.metrics.items(session.name, seconds, len(failed))


def _room(arenas: Arenas, need: int) -> list[Any]:
    """The answer to a flush: the output arena, grown to `need` bytes if it must be, or why the
    row that needs them is run on the host (the worker waits for one of the two). While it may
    be kept, it grows to twice its size, so that rows of a few MiB soon share a flush."""
    more = max(need, min(2 * arenas.size(OUT), arenas.keep))
    try:
        if (more > need and arenas.fit(OUT, more)) or arenas.fit(OUT, need):
            return ["go", arenas.where(OUT)]
        why = arenas.why(OUT, need)
    except WorkerGone as exc:  # shared memory has no room
        why = str(exc)
    return ["skip", SLOT_OVERFLOW, why]


def _results(slot: Any, out: np.ndarray | None, results: list[Any], failed: dict, finished: set):
    """Stamp the rows a worker answered for, their outputs of varying shape copied out of the
    output arena (the next rows' are written there)."""
    stamps = slot.stamps.rows
    for row, reason, detail, wrote, ragged in results:
        if reason:
            failed[row] = (reason, detail)
        else:
            for k in wrote:
                stamps[k][row] = row + 1
            for k, dtype, shape, off in ragged:
                got = np.empty(shape, dtype)
                n = got.nbytes
                if n:
                    if out is None or off < 0 or off + n > out.size:
                        raise ValueError(f"a worker put {n} bytes at {off} of a smaller arena")
                    got.reshape(-1).view(np.uint8)[:] = out[off : off + n]
                slot.ragged[k][row] = got
                stamps[k][row] = row + 1
        finished.add(row)
