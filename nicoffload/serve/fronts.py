"""`serve --fronts N`: N front processes (`front.py`) parse and answer the requests, the Session
stays in this one. One listening socket, made here, is shared by every front (each accepts on
it; a connection not yet accepted survives a front's death); gRPC's port, which grpcio binds by
address, is shared with SO_REUSEPORT. A front's requests come in on its control socket, in
groups, their items in its request slots, one reader thread per front feeding the Batcher
(`frontlink`); the answers go back from the batcher's thread, a round's in one frame, their
outputs in the response slots.

A front that dies is started again from the main thread (its PDEATHSIG is tied to the thread
that started it); the requests it had in flight are answered to nobody, counted
(`lost_in_flight`) and logged (their clients saw the connection close). More than
MAX_RESTARTS restarts: serve stops, exit 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nicoffload.serve import frontwire as wire
from nicoffload.serve.batcher import Batcher
from nicoffload.serve.frontlink import FrontLink, LinkCounts

log = logging.getLogger("nicoffload.serve")
MAX_RESTARTS = 20
READY_S = 120.0  # for a front to start and say it listens
ALONE_S = 1.0  # a front that drained while serve does not: it exits after this (`_drained`)


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
    """One front process and the Session's end of its control socket."""

    index: int
    proc: subprocess.Popen
    link: FrontLink
    pid: int = 0
    event_loop: str = ""  # what it runs on (`eventloop.chosen()` there)


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
        self.links: list[FrontLink] = []  # every front's, the dead ones' too: their counts
        self._count = threading.Lock()
        self._closing = threading.Lock()  # `closing` set, or read before an early `exit`
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

    @property
    def event_loop(self) -> str:
        """The fronts' event loop ("uvloop" | "asyncio"; both, comma-separated, should they
        differ)."""
        return ",".join(sorted({f.event_loop for f in self.fronts if f is not None}))

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
        req, resp = self.segments[i]
        link = FrontLink(self.batcher, mine, req, resp, self.slot_bytes)
        front = Front(i, proc, link, hello[1], hello[2])
        link.on_drained = lambda: self._drained(front)
        self.links.append(front.link)
        self.fronts[i] = front
        threading.Thread(
            target=self._read, args=(front,), name=f"nicoffload-front{i}", daemon=True
        ).start()

    def _read(self, f: Front) -> None:
        lost = f.link.serve()
        code = f.proc.wait()
        if self.closing and f.link.drained:
            return
        with self._count:  # fronts killed together end on their readers side by side
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

    def _drained(self, f: Front) -> None:
        """Front f drained: in serve's drain it waits for `exit` until every front has; one
        that drained on its own (SIGTERM sent to it alone) exits, and is restarted, rather than
        answer 503 to its share of the shared socket's connections for ever. After ALONE_S: a
        SIGTERM sent to the process group reaches serve too, whose drain starts by then."""

        def alone() -> None:
            with self._closing:
                if not self.closing:
                    f.link.send(("exit",))

        timer = threading.Timer(ALONE_S, alone)
        timer.daemon = True
        timer.start()

    def flush(self) -> None:
        """Each front's gathered answers in one frame (the batcher's `after_answers`)."""
        for f in self.fronts:
            if f is not None and f.link.unsent:
                f.link.flush()

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
        with self._closing:
            self.closing = True
        live = [f for f in self.fronts if f is not None and not f.link.dead]
        for f in live:
            f.link.send(("drain",))
        end = time.monotonic() + timeout_s
        # each keeps answering 503 until all have drained, then all exit: the shared socket has
        # a front accepting on it to the end
        for f in live:
            f.link.settled.wait(max(0.1, end - time.monotonic()))
        for f in live:
            f.link.send(("exit",))
        for f in live:
            try:
                f.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("front %d did not drain in %g s: killed", f.index, timeout_s)
                f.proc.kill()
                f.proc.wait()

    def stats(self) -> dict[str, Any]:
        counts = [dataclasses.asdict(link.counts) for link in self.links]
        names = [f.name for f in dataclasses.fields(LinkCounts)]
        total: dict[str, Any] = {k: sum(c[k] for c in counts) for k in names}
        return total | {
            "restarts": self.restarts,
            "lost_in_flight": self.lost_in_flight,
            "event_loop": self.event_loop,
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
