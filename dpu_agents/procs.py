"""The agent's kernels in worker processes, one per core (`processes` in the config): a pool with
the interface of `session.WorkerPool` whose threads each drive one process (`dpu_agents.worker`).

A session's batch slots are one shared-memory segment (`shared_slots`) that every worker maps;
a worker thread takes rows of a batch, copies their values into its process's input arena
(shared memory too, grown as needed), sends the rows' places in one message and gets back which
rows failed and why, which outputs each wrote, the outputs of varying shape, and the step times.
The GIL is held only around that message: the kernels run in processes of their own.

A worker process that dies fails the rows it held (`internal`, with its exit status: the host
runs them itself) and is started again, the loaded stages built in it anew.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from dpu_agents.logs import log_event
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import TensorSpec
from nicoffload.runtime.batch import WORKER_LOST
from nicoffload.transport.shm import Segment
from nicoffload.transport.slots import ALIGN

log = logging.getLogger("dpu_agents.procs")
READY_S = 120.0  # a new worker imports numpy, numba and the kernels (their cache on disk)
LOAD_S = 300.0  # a stage built in a worker: its kernels compiled, or read from numba's cache
MAX_MESSAGE = 1 << 34
BYTES, TENSOR, TEXT = 0, 1, 2  # how a value lies in the arena: bytes, an array, utf-8 text
_local = threading.local()


class Link:
    """Length-prefixed msgpack messages over a stream socket."""

    _LEN = struct.Struct("<Q")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        head = self._LEN.pack(len(data))
        if len(data) < 65536:  # one write
            self.sock.sendall(head + data)
        else:  # no copy of a large one
            self.sock.sendall(head)
            self.sock.sendall(data)

    def recv(self) -> Any:
        (n,) = self._LEN.unpack(self._exact(self._LEN.size))
        if n > MAX_MESSAGE:
            raise EOFError(f"a message of {n} bytes")
        return msgspec.msgpack.decode(self._exact(n))

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the other end closed")
            got += k
        return buf


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def shared_slots(
    specs: dict[str, TensorSpec], batch: int, count: int
) -> tuple[Segment, list[list[Any]]]:
    """One segment holding `count` slots of the static outputs, and where each array lies:
    [[key, offset, dtype, shape], ...] per slot."""
    layout, at = [], 0
    for _ in range(count):
        slot = []
        for k, s in specs.items():
            if s.static:
                shape = [batch, *s.shape]
                slot.append([k, at, np.dtype(s.dtype).str, shape])
                at += _aligned(math.prod(shape) * np.dtype(s.dtype).itemsize)
        layout.append(slot)
    seg = Segment(f"nicoffload-slots-{secrets.token_hex(8)}", max(at, ALIGN), create=True)
    return seg, layout


def slot_views(seg: Segment, layout: list[list[Any]]) -> list[dict[str, np.ndarray]]:
    """The arrays of each slot, as views of the segment."""
    buf = seg.array
    assert buf is not None
    out = []
    for slot in layout:
        arrays = {}
        for k, off, dtype, shape in slot:
            n = math.prod(shape) * np.dtype(dtype).itemsize
            arrays[k] = buf[off : off + n].view(dtype).reshape(shape)
        out.append(arrays)
    return out


class WorkerGone(Exception):
    """The worker process exited (or stopped answering) during a call."""


class Proc:
    """The agent's side of one worker process, used by one thread at a time (`lock`)."""

    def __init__(
        self, index: int, loads: Callable[[], list[list[Any]]], run_s: float = 120.0
    ) -> None:
        """`run_s`: how long a call on rows may take before the worker is taken as stuck
        (stopped, or in a kernel that does not return) and killed."""
        self.index, self._loads, self.run_s = index, loads, run_s
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.link: Link | None = None
        self._ready = False
        self.arena: Segment | None = None
        self.out: Segment | None = None
        self.restarts = 0
        self.start()

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dpu_agents.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
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
        if self.link is None:
            self._restart()
        try:
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

    def _restart(self) -> None:
        self.restarts += 1
        self.start()

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.sock.close()
        self.link = None

    def ensure_arena(self, n: int) -> Segment:
        """An input arena of at least n bytes (a new, larger one replaces a small one)."""
        self.arena = _at_least(self.arena, n, "in")
        return self.arena

    def ensure_out(self, n: int) -> Segment:
        """An output arena (for outputs of varying shape) of at least n bytes."""
        self.out = _at_least(self.out, n, "out")
        return self.out

    def close(self, timeout: float) -> None:
        self._drop_link()  # the worker exits when its socket closes
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for seg in (self.arena, self.out):
            if seg is not None:
                seg.close()
        self.arena = self.out = None


def _at_least(seg: Segment | None, n: int, what: str) -> Segment:
    """`seg` if it holds n bytes, else a new one; WorkerGone (its rows go to the host) when
    shared memory has no room for it."""
    if seg is not None and seg.array is not None and seg.array.size >= n:
        return seg
    if seg is not None:
        seg.close()
    size = 1 << (max(n, 1 << 20) - 1).bit_length()
    try:
        return Segment(f"nicoffload-{what}-{secrets.token_hex(8)}", size, create=True)
    except TransportError as exc:
        raise WorkerGone(str(exc)) from None


class ProcPool:
    """`n` worker processes, each driven by a thread of this process; tasks as WorkerPool's."""

    processes = True

    def __init__(self, n: int, run_s: float = 120.0) -> None:
        self.n, self.run_s = n, run_s
        self._loads: dict[int, list[Any]] = {}
        self._loads_lock = threading.Lock()
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.procs = [Proc(i, self.loads, run_s) for i in range(n)]
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


def current() -> Proc:
    """The worker process of the pool thread running this task."""
    return _local.proc


def run_rows(session: Any, job: Any) -> None:
    """`Session._run` with the kernels in this pool thread's worker process: rows taken a few at a
    time (so the batch still spreads over every worker), their values copied into the
    worker's arena, and one message each way per chunk."""
    proc = current()
    batch, slot = job.batch, job.batch.slot
    chunk = max(1, -(-job.n // (2 * session.pool.n)))
    while rows := list(itertools.islice(job.left, chunk)):
        failed: dict[int, tuple[str, str]] = {}
        try:
            with proc.lock:
                reply = _chunk(session, proc, slot, rows)
            if reply[0] != "done":
                raise WorkerGone(str(reply[1]))
            _, results, seconds, cpu_ns, wall_ns, calls, need = reply
            stamps = slot.stamps.rows
            out = proc.out.array if proc.out is not None else None
            for row, reason, detail, wrote, ragged in results:
                if reason:
                    failed[row] = (reason, detail)
                    continue
                for k in wrote:
                    stamps[k][row] = row + 1
                for k, dtype, shape, off, data in ragged:
                    if off >= 0:  # copied out: the arena is the next chunk's
                        n = math.prod(shape) * np.dtype(dtype).itemsize
                        got = out[off : off + n].view(dtype).reshape(shape).copy()
                    else:
                        got = np.frombuffer(data, dtype).reshape(shape)
                    slot.ragged[k][row] = got
                    stamps[k][row] = row + 1
            if need > (out.size if out is not None else 0):
                proc.ensure_out(need)  # the next chunk's fit
            tally = session.built.stage.tally()
            tally.cpu_ns, tally.wall_ns, tally.calls = cpu_ns, wall_ns, calls
            session.built.stage.add(tally)
            if seconds:
                session.metrics.items(session.name, seconds, len(failed))
            for reason, _ in failed.values():
                session.metrics.error(reason)
        except WorkerGone as exc:  # a row it did not answer for is sent unwritten
            failed = {row: (WORKER_LOST, str(exc)) for row, _ in rows}
            for _ in rows:
                session.metrics.error(WORKER_LOST)
        except Exception as exc:  # a bug here fails the rows, never the session
            detail = f"{type(exc).__name__}: {exc}"
            failed = {row: ("internal", detail) for row, _ in rows}
            session.metrics.error("internal")
            log_event(log, logging.ERROR, "item_failed", stage=session.name, error=detail)
        finally:
            for _, values in rows:
                values.clear()
            batch.finish_rows(len(rows), failed)


def _chunk(session: Any, proc: Proc, slot: Any, rows: list) -> list[Any]:
    """Copy the rows' values into the worker's arena and run them there."""
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
                raw = np.frombuffer(v.encode("utf-8"), np.uint8)
                where.append([k, TEXT, at, raw.size, "|u1", [raw.size]])
            else:
                raw = np.frombuffer(v, np.uint8)
                where.append([k, BYTES, at, raw.size, "|u1", [raw.size]])
            parts.append((at, raw))
            at += -(-raw.size // ALIGN) * ALIGN
        places.append([row, where])
    arena = proc.ensure_arena(at)
    out = proc.out or proc.ensure_out(0)
    buf = arena.array
    assert buf is not None and out.array is not None
    for off, raw in parts:
        buf[off : off + raw.size] = raw
    where = [[arena.name, buf.size], [out.name, out.array.size]]
    return proc.call(["run", session.key, slot.index, *where, places])
