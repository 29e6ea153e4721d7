"""One front process of `serve --fronts N` (`python -m nicoffload.serve.front FD`): the HTTP
endpoint (and gRPC's with --grpc) of `server.Server`, whose batcher is the Session's process at
the other end of the control socket FD (`RemoteBatcher`). It parses and checks each request as
the in-process server does, puts its items in a shared-memory slot, and encodes the answer
from the same slot (`frontwire`).

It takes the listening socket it is given (one listener for all fronts: a connection waiting
to be accepted survives a front's death), drains on the Session process's word or on its own
SIGTERM, and exits when that process goes (the socket's end; PDEATHSIG besides).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import threading
from typing import Any

from nicoffload.serve import eventloop
from nicoffload.serve import frontwire as wire
from nicoffload.serve.batcher import Outcome, Pending
from nicoffload.serve.kserve import RequestError

log = logging.getLogger("nicoffload.serve")
PR_SET_PDEATHSIG = 1


class RemoteBatcher:
    """What `Server` asks of a Batcher (`submit`, `max_queue`, `ended`), answered by the
    Session's process: the requests submitted in one turn of the event loop go there as one
    frame (a group; their items in free slots), their Outcomes come back in groups (`answer`),
    each one's outputs in its slot until the response is encoded."""

    def __init__(self, writer: asyncio.StreamWriter, segments: dict[str, Any], max_queue: int):
        from nicoffload.transport.shm import Segment

        self.writer, self.max_queue = writer, max_queue
        self.slots, self.slot_bytes = segments["slots"], segments["slot_bytes"]
        size = self.slots * self.slot_bytes
        self._req = Segment(segments["request"], size, create=False)
        self._resp = Segment(segments["response"], size, create=False)
        self.free = list(range(self.slots))[::-1]  # a stack: the same few slots stay hot
        self.ended = threading.Event()
        self._pending: dict[int, tuple[Pending, int | None]] = {}
        self._ids = itertools.count(1)
        self._group: list[tuple] = []  # submitted this turn of the loop, sent at its end
        self._loop = asyncio.get_running_loop()

    def _slot(self, seg: Any, i: int) -> Any:
        return seg.array[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def submit(self, p: Pending) -> None:
        n = len(p.items)
        if n > self.max_queue:
            raise RequestError(
                f"{n} items in one request, more than --max-queue {self.max_queue}", 413
            )
        if self.ended.is_set():
            raise RuntimeError("the serving stream has ended")
        slot = self.free.pop() if self.free else None
        layout = None if slot is None else wire.put_items(self._slot(self._req, slot), p.items)
        rid = next(self._ids)
        self._pending[rid] = (p, slot)
        payload = layout if layout is not None else p.items  # inline: counted over there
        if not self._group:  # the first of this turn: every handler that runs in it joins
            self._loop.call_soon(self._send)
        self._group.append(
            (rid, slot, layout is not None, payload, p.arrived, p.parsed, p.deadline)
        )

    def _send(self) -> None:
        group, self._group = self._group, []
        if group and not self.ended.is_set():
            self.writer.write(wire.frame(("reqs", group)))

    def _giver(self, slot: int) -> Any:
        given = False

        def release() -> None:
            nonlocal given
            if not given:
                given = True
                self.free.append(slot)

        return release

    def answer(self, msg: tuple) -> None:
        """A group of answers (`anss`): each request's Outcome to its handler."""
        for rid, status, error, timings, retry, decided, where, outs in msg[1]:
            got = self._pending.pop(rid, None)
            if got is None:  # answered already (`end`)
                continue
            p, slot = got
            release = None
            if where == "slot":
                assert slot is not None
                outs = wire.get_outputs(self._slot(self._resp, slot), outs)
                release = self._giver(slot)
            elif slot is not None:
                self.free.append(slot)
            p.on_done(Outcome(status, outs, error, timings, retry, decided, release))

    def end(self, why: str) -> None:
        """The Session's process is gone: every request waiting is answered 503."""
        self.ended.set()
        self._group = []
        for rid in list(self._pending):
            p, _ = self._pending.pop(rid)
            p.on_done(Outcome(503, error=f"server not ready: {why}"))


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the Session's process dies (its spawning thread is its main thread)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message from the Session's process (IncompleteReadError at its end)."""
    head = await reader.readexactly(wire.HEADER.size)
    (n,) = wire.HEADER.unpack(head)
    return pickle.loads(await reader.readexactly(n))


async def run(control: socket.socket, cfg: dict[str, Any]) -> int:
    from aiohttp import web

    from nicoffload.graph import load_pipeline
    from nicoffload.serve.server import ServeConfig, Server

    pipeline = load_pipeline(cfg["pipeline"])
    reader, writer = await asyncio.open_unix_connection(sock=control)
    batcher = RemoteBatcher(writer, cfg["segments"], cfg["max_queue"])
    server = Server(pipeline, batcher, ServeConfig(**cfg["config"]), cfg["outputs"])
    listener = socket.socket(fileno=cfg["listen_fd"])
    runner = web.AppRunner(server.app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listener).start()
    grpc_server = None
    if cfg["grpc"] is not None:
        from nicoffload.serve import grpc_server as g

        grpc_server, _ = await g.start(server, *cfg["grpc"])
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, drain.set)
    writer.write(wire.frame(("ready", os.getpid(), eventloop.chosen())))

    async def messages() -> str:
        while True:
            try:
                msg = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return "the Session's process is gone"
            if msg[0] == "anss":
                batcher.answer(msg)
            elif msg[0] == "drain":
                drain.set()
            elif msg[0] == "exit":
                return ""

    reading = asyncio.ensure_future(messages())
    draining = asyncio.ensure_future(drain.wait())
    await asyncio.wait([reading, draining], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if reading.done():  # the other end went first: nothing can be answered any more
        batcher.end(reading.result())
        code = 1
    else:
        await server.drain()  # the answers still come in on `reading`
        writer.write(wire.frame(("drained", os.getpid())))
        await writer.drain()
        # still accepting, answering 503, until every front has drained: a connection this
        # front took from the shared socket is answered, not closed unread as it goes
        await reading
    draining.cancel()
    if grpc_server is not None:
        await grpc_server.stop(None)
    await runner.cleanup()
    return code


def main(argv: list[str]) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    control = socket.socket(fileno=int(argv[0]))
    _die_with_parent(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the Session's process
    cfg = wire.recv(control)
    if cfg is None:
        return 1
    sys.setswitchinterval(cfg["switch_interval_s"])
    from nicoffload.serve.threads import name_os_threads

    name_os_threads()
    return eventloop.run(run(control, cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
