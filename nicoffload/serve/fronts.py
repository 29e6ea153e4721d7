"""`serve --fronts N`: N front processes (`front.py`) parse and answer the requests, the Session
stays in this one. One listening socket, made here, is shared by every front (each accepts on
it; a connection not yet accepted survives a front's death); gRPC's port, which grpcio binds by
address, is shared with SO_REUSEPORT. A front's requests come in on its control socket, their
items in its request slots (`frontwire`), one reader thread per front feeding the Batcher; each
answer goes back from the batcher's thread, its outputs in the response slot.

A front that dies is started again from the main thread (its PDEATHSIG is tied to the thread
that started it); the requests it had in flight are answered to nobody, counted
(`lost_in_flight`) and logged (their clients saw the connection close). More than
MAX_RESTARTS restarts: serve stops, exit 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.serve import frontwire as wire
from nicoffload.serve.batcher import Batcher, Outcome, Pending, QueueFull
from nicoffload.serve.kserve import RequestError

log = logging.getLogger("nicoffload.serve")
MAX_RESTARTS = 20
READY_S = 120.0  # for a front to start and say it listens


def listener(host: str, port: int, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (OSError when it cannot be), listening unless not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        if listen:
            s.listen(1024)
        s.set_inheritable(True)
    except BaseException:
        s.close()
        raise
    return s


@dataclass
class Front:
    """One front process and its end of the control socket."""

    index: int
    proc: subprocess.Popen
    sock: socket.socket
    pid: int = 0
    dead: bool = False
    drained: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: set[int] = field(default_factory=set)
    unsent: list[bytes] = field(default_factory=list)  # answers gathered, for one write


class Fronts:
    """The front processes of one Session: started, fed, restarted, drained."""

    def __init__(
        self,
        batcher: Batcher,
        front_cfg: dict[str, Any],
        n: int,
        listen: tuple[str, int],
        grpc_at: tuple[str, int] | None,
        slots: int,
        slot_bytes: int,
    ) -> None:
        from nicoffload.transport.shm import Segment

        self.batcher, self.n = batcher, n
        self.slots, self.slot_bytes = slots, slot_bytes
        self.listen = listener(*listen)
        self.grpc_hold = None if grpc_at is None else listener(*grpc_at, True, listen=False)
        self.segments: list[tuple[Any, Any]] = []
        self.fronts: list[Front | None] = [None] * n
        self.closing = False
        self.failure: str | None = None
        self.restarts = 0
        self.lost_in_flight = 0  # requests a dead front had forwarded: their answers dropped
        self.requests = 0
        self.inline_requests = 0  # items that did not fit a slot (or found none): in the frame
        self.inline_responses = 0
        self._count = threading.Lock()
        batcher.after_answers.append(self.flush)
        self.on_exit: Callable[[int], None] = lambda i: None  # set by serve: restart or stop
        size = slots * slot_bytes
        tag = f"nicoffload-front-{os.getpid()}"
        try:
            for i in range(n):
                self.segments.append(
                    (
                        Segment(f"{tag}-{i}-req", size, create=True),
                        Segment(f"{tag}-{i}-resp", size, create=True),
                    )
                )
        except BaseException:
            self.close()
            raise
        grpc = None
        if self.grpc_hold is not None:
            grpc = (grpc_at[0] if grpc_at else "", self.grpc_hold.getsockname()[1])
        self.cfg = {**front_cfg, "grpc": grpc, "listen_fd": self.listen.fileno()}

    @property
    def port(self) -> int:
        return int(self.listen.getsockname()[1])

    @property
    def grpc_port(self) -> int | None:
        return None if self.grpc_hold is None else int(self.grpc_hold.getsockname()[1])

    def pids(self) -> list[int]:
        return [f.pid for f in self.fronts if f is not None]

    def start(self) -> None:
        """Every front started (side by side: each takes a second or two to import) and
        listening."""
        launched = [self._launch(i) for i in range(self.n)]
        for i, (proc, sock) in enumerate(launched):
            self._ready(i, proc, sock)

    def spawn(self, i: int) -> None:
        """Front i started and listening (call on the main thread). OSError/RuntimeError when
        it does not come up."""
        self._ready(i, *self._launch(i))

    def _launch(self, i: int) -> tuple[subprocess.Popen, socket.socket]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req, resp = self.segments[i]
        cfg = {
            **self.cfg,
            "index": i,
            "segments": {
                "request": req.name,
                "response": resp.name,
                "slots": self.slots,
                "slot_bytes": self.slot_bytes,
            },
        }
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nicoffload.serve.front",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(), self.listen.fileno()),
            )
        finally:
            theirs.close()
        wire.send(mine, cfg)
        return proc, mine

    def _ready(self, i: int, proc: subprocess.Popen, mine: socket.socket) -> None:
        front = Front(i, proc, mine)
        mine.settimeout(READY_S)
        try:
            hello = wire.recv(mine)
        except OSError:
            hello = None
        if not hello or hello[0] != "ready":
            proc.kill()
            proc.wait()
            mine.close()
            raise RuntimeError(f"front {i} did not start (exit {proc.returncode})")
        mine.settimeout(None)
        front.pid = hello[1]
        self.fronts[i] = front
        threading.Thread(
            target=self._read, args=(front,), name=f"nicoffload-front{i}", daemon=True
        ).start()

    def _read(self, f: Front) -> None:
        stream = f.sock.makefile("rb", buffering=1 << 20)
        while True:
            try:
                msg = wire.read(stream)
            except (OSError, ValueError, EOFError, ImportError, ConnectionError):
                msg = None
            if msg is None:
                break
            if msg[0] == "req":
                self._request(f, msg)
            elif msg[0] == "drained":
                f.drained = True
        with f.lock:
            f.dead = True
            lost = len(f.in_flight)
        stream.close()
        f.sock.close()
        code = f.proc.wait()
        if self.closing and f.drained:
            return
        with self._count:
            self.lost_in_flight += lost
        log.warning(
            "front %d (pid %d) ended (exit %s) with %d requests in flight: their answers are "
            "dropped (their clients saw the connection close)",
            f.index,
            f.pid,
            code,
            lost,
        )
        if not self.closing:
            self.on_exit(f.index)

    def _request(self, f: Front, msg: tuple) -> None:
        forwarded = time.perf_counter()
        _, rid, slot, in_slot, payload, arrived, parsed, deadline = msg
        items = wire.get_items(self._slot(f, 0, slot), payload) if in_slot else payload
        with self._count:
            self.requests += 1
            self.inline_requests += not in_slot
        with f.lock:
            f.in_flight.add(rid)

        def on_done(outcome: Outcome) -> None:
            self._reply(f, rid, slot, outcome)

        p = Pending(items, on_done, arrived, parsed, deadline, forwarded=forwarded)
        try:
            self.batcher.submit(p)
            return
        except QueueFull as exc:
            self._reply(f, rid, slot, Outcome(503, error=str(exc), retry=True))
        except RequestError as exc:
            self._reply(f, rid, slot, Outcome(exc.status, error=exc.message))
        except RuntimeError as exc:
            self._reply(f, rid, slot, Outcome(503, error=f"server not ready: {exc}"))
        self._flush(f)  # a refusal goes at once

    def _slot(self, f: Front, which: int, slot: int) -> np.ndarray:
        seg = self.segments[f.index][which]
        return seg.array[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def _reply(self, f: Front, rid: int, slot: int | None, outcome: Outcome) -> None:
        with f.lock:
            f.in_flight.discard(rid)
            if f.dead:
                return
            where, outs = "none", None
            if outcome.outputs is not None:
                layout = None
                if slot is not None:
                    layout = wire.put_outputs(self._slot(f, 1, slot), outcome.outputs)
                if layout is None:
                    where = "inline"
                    outs = {k: np.asarray(v) for k, v in outcome.outputs.items()}
                    with self._count:
                        self.inline_responses += 1
                else:
                    where, outs = "slot", layout
            msg = (
                "ans",
                rid,
                outcome.status,
                outcome.error,
                outcome.timings,
                outcome.retry,
                outcome.decided,
                where,
                outs,
            )
            f.unsent.append(wire.frame(msg))  # sent by `flush`, after the batcher's round

    def _flush(self, f: Front) -> None:
        with f.lock:
            data, f.unsent = b"".join(f.unsent), []
            if data and not f.dead:
                # it may have died meanwhile: its reader counts what it had in flight
                with contextlib.suppress(OSError):
                    f.sock.sendall(data)

    def flush(self) -> None:
        """Each front's gathered answers in one write (the batcher's `after_answers`)."""
        for f in self.fronts:
            if f is not None and f.unsent:
                self._flush(f)

    def restart(self, i: int) -> None:
        """Front i again (main thread); past MAX_RESTARTS, `failure` says why serve stops."""
        if self.closing:
            return
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            self.failure = f"fronts died {self.restarts} times (at most {MAX_RESTARTS})"
            return
        try:
            self.spawn(i)
        except (OSError, RuntimeError) as exc:
            self.failure = f"front {i} could not be restarted: {exc}"
            return
        log.warning("front %d restarted (pid %d)", i, self.fronts[i].pid)

    def drain(self, timeout_s: float) -> None:
        """Every front drains (answers what it has, refuses the rest) and exits; blocks."""
        self.closing = True
        live = [f for f in self.fronts if f is not None and not f.dead]
        for f in live:
            with f.lock, contextlib.suppress(OSError):
                wire.send(f.sock, ("drain",))
        end = time.monotonic() + timeout_s
        for f in live:
            try:
                f.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("front %d did not drain in %g s: killed", f.index, timeout_s)
                f.proc.kill()
                f.proc.wait()

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "inline_requests": self.inline_requests,
            "inline_responses": self.inline_responses,
            "restarts": self.restarts,
            "lost_in_flight": self.lost_in_flight,
        }

    def close(self) -> None:
        self.closing = True
        for f in self.fronts:
            if f is not None and f.proc.poll() is None:
                f.proc.kill()
                f.proc.wait()
        for pair in self.segments:
            for seg in pair:
                seg.close()
        self.segments = []
        self.listen.close()
        if self.grpc_hold is not None:
            self.grpc_hold.close()
