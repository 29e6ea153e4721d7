"""The Session process's end of one front's control socket (`serve --fronts`): a group of
requests the front had ready together comes in as one frame (`frontwire`) and goes into the
Batcher in one step; the answers decided in one round of the batcher go back as one frame.
So what the Session's process spends per request is the request's own work (its items out of
the slot, its outputs into one), not a system call, a pickle and a lock hand-off each.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.serve import frontwire as wire
from nicoffload.serve.batcher import Batcher, Outcome, Pending, refusal


@dataclass
class LinkCounts:
    requests: int = 0
    request_groups: int = 0  # frames of requests: requests / groups is the mean group
    answer_groups: int = 0  # frames of answers
    inline_requests: int = 0  # items that did not fit a slot (or found none): in the frame
    inline_responses: int = 0


class FrontLink:
    """One front's control socket and shared-memory slots, on the Session's side: `serve()`
    reads its groups until the front goes; the batcher's thread answers through `_reply` and
    sends what it gathered with `flush()`."""

    def __init__(
        self, batcher: Batcher, sock: socket.socket, request: Any, response: Any, slot_bytes: int
    ) -> None:
        self.batcher, self.sock, self.slot_bytes = batcher, sock, slot_bytes
        self._slots = (request.array, response.array)  # the segments' bytes
        self.counts = LinkCounts()
        self.dead = False
        self.drained = False
        self.settled = threading.Event()  # drained, or gone
        self.on_drained: Callable[[], None] = lambda: None  # on the reader's thread
        # guards `in_flight`, `unsent`, `dead`, the counts and the socket's writes; held while
        # an answer's outputs go into their slot, so that none lands once the front is gone
        # (its slots go to the front started in its place)
        self.lock = threading.Lock()
        self.in_flight: set[int] = set()
        self.unsent: list[tuple] = []  # answers gathered, for one frame

    def serve(self) -> int:
        """Read the front's groups until it closes or dies; how many of its requests were in
        flight then (their answers go to nobody)."""
        stream = self.sock.makefile("rb", buffering=1 << 20)
        while True:
            try:
                msg = wire.read(stream)
            except (OSError, ValueError, EOFError, ImportError, ConnectionError):
                msg = None
            if msg is None:
                break
            if msg[0] == "reqs":
                self._requests(msg[1])
            elif msg[0] == "drained":
                self.drained = True
                self.settled.set()
                self.on_drained()
        with self.lock:
            self.dead = True
            lost = len(self.in_flight)
        self.settled.set()
        stream.close()
        self.sock.close()
        return lost

    def send(self, msg: Any) -> None:
        """A message to the front (`drain`, `exit`); nothing when it has gone."""
        with self.lock, contextlib.suppress(OSError):
            wire.send(self.sock, msg)

    def _slot(self, which: int, slot: int) -> np.ndarray:
        return self._slots[which][slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def _requests(self, group: list[tuple]) -> None:
        forwarded = time.perf_counter()
        ps, inline = [], 0
        for rid, slot, in_slot, payload, arrived, parsed, deadline in group:
            items = wire.get_items(self._slot(0, slot), payload) if in_slot else payload
            inline += not in_slot
            on_done = functools.partial(self._reply, rid, slot)
            p = Pending(items, on_done, arrived, parsed, deadline, forwarded, copies_at_once=True)
            ps.append(p)
        with self.lock:
            self.in_flight.update(rid for rid, *_ in group)
            self.counts.requests += len(group)
            self.counts.request_groups += 1
            self.counts.inline_requests += inline
        refused = self.batcher.submit_many(ps)
        for (rid, slot, *_), exc in zip(group, refused, strict=True):
            if exc is not None:
                self._reply(rid, slot, refusal(exc))
        if any(exc is not None for exc in refused):
            self.flush()  # a refusal goes at once

    def _reply(self, rid: int, slot: int | None, outcome: Outcome) -> None:
        with self.lock:
            self.in_flight.discard(rid)
            if self.dead:
                return
            where, outs = "none", None
            if outcome.outputs is not None:
                layout = None
                if slot is not None:
                    layout = wire.put_outputs(self._slot(1, slot), outcome.outputs)
                if layout is None:  # copied: they may be views into the runtime's batch
                    where = "inline"
                    outs = {k: np.array(v) for k, v in outcome.outputs.items()}
                    self.counts.inline_responses += 1
                else:
                    where, outs = "slot", layout
            self.unsent.append(
                (
                    rid,
                    outcome.status,
                    outcome.error,
                    outcome.timings,
                    outcome.retry,
                    outcome.decided,
                    where,
                    outs,
                )
            )

    def flush(self) -> None:
        """The answers gathered, in one frame (after the batcher's round, or a refusal)."""
        with self.lock:
            group, self.unsent = self.unsent, []
            if group and not self.dead:
                self.counts.answer_groups += 1
                # it may have died meanwhile: `serve` counts what it had in flight
                with contextlib.suppress(OSError):
                    self.sock.sendall(wire.frame(("anss", group)))
