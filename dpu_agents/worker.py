"""One of the agent's worker processes (`python -m dpu_agents.worker FD`): it builds each loaded
stage as LOAD did (`build_stage`, the same text), and runs the rows the agent gives it, reading
their values from an input arena and writing their outputs straight into the batch slot, both
shared memory the agent made (mode 600, checked on attach). Messages are msgpack over the
socket FD (`procs.Link`); nothing is unpickled.

The agent runs one such process per core so that its kernels run in parallel without sharing a
GIL: with threads, the GIL taken back after every kernel call capped an 8-core agent at about
5.7 cores' worth (bench/RESULTS.md). It ignores SIGINT and SIGTERM (the agent drains, then closes
the socket) and exits when the socket closes.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from typing import Any

import numpy as np

from dpu_agents.config import AgentConfig
from dpu_agents.procs import BYTES, TEXT, Link, slot_views
from dpu_agents.stagebuild import Built, build_stage
from nicoffload.errors import ItemError
from nicoffload.transport.shm import Segment
from nicoffload.transport.slots import ALIGN


class Worker:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.stages: dict[int, tuple[Built, Segment, list[dict[str, np.ndarray]]]] = {}
        self.arena: Segment | None = None
        self.out: Segment | None = None

    def serve(self) -> None:
        self.link.send(["ready"])
        while True:
            try:
                msg = self.link.recv()
            except (EOFError, OSError):
                return
            op = msg[0]
            try:
                reply = getattr(self, f"_{op}")(*msg[1:])
            except Exception as exc:  # a bad message or a failed build: the agent is told
                reply = ["error", f"{type(exc).__name__}: {exc}"]
            self.link.send(reply)

    def _load(
        self, key: int, source: list[Any], cfg: dict[str, Any], segment: list[Any], layout: list
    ) -> list[Any]:
        yaml_text, plan_text, stage, batch, wait_ms = source
        cfg["forward_allow"] = tuple(cfg["forward_allow"])
        built = build_stage(yaml_text, plan_text, stage, batch, wait_ms, AgentConfig(**cfg))
        seg = Segment(segment[0], segment[1], create=False)
        self._drop(key)  # loaded again (a restarted worker is given every stage)
        self.stages[key] = (built, seg, slot_views(seg, layout))
        return ["ok"]

    def _drop(self, key: int) -> list[Any]:
        got = self.stages.pop(key, None)
        if got is not None:
            got[1].close()
        return ["ok"]

    def _attach(self, have: Segment | None, name: str, size: int) -> Segment:
        if have is not None and have.name == name:
            return have
        if have is not None:
            have.close()
        return Segment(name, size, create=False)

    def _run(
        self, key: int, slot: int, arena: list[Any], out: list[Any], rows: list[Any]
    ) -> list[Any]:
        """The rows' values from the input arena; outputs of varying shape into the output
        arena while they fit (the agent copies them out), else in the reply; `need` says how
        large an output arena would have held them all."""
        self.arena = self._attach(self.arena, arena[0], arena[1])
        self.out = self._attach(self.out, out[0], out[1])
        built, _, slots = self.stages[key]
        stage, arrays = built.stage, slots[slot]
        buf, room = self.arena.array, self.out.array
        assert buf is not None and room is not None
        used = 0
        ragged = [k for k, s in built.out_specs.items() if not s.static]
        tally = stage.tally()
        done, seconds = [], []
        for row, where in rows:
            values: dict[str, Any] = {}
            for k, kind, off, n, dtype, shape in where:
                part = buf[off : off + n]
                if kind == BYTES:
                    values[k] = memoryview(part)
                elif kind == TEXT:
                    values[k] = part.tobytes().decode("utf-8")
                else:
                    values[k] = part.view(dtype).reshape(shape)
            t0 = time.perf_counter()
            try:
                written = stage.process(values, {k: a[row] for k, a in arrays.items()}, tally)
                wrote = []
                for k, a in arrays.items():
                    if k in values:  # else unstamped: the row is sent as failed
                        if k not in written:
                            a[row] = values[k]
                        wrote.append(k)
                rag = []
                for k in ragged:
                    a = np.ascontiguousarray(values[k])
                    flat = a.reshape(-1).view(np.uint8)
                    if used + flat.size <= room.size:
                        room[used : used + flat.size] = flat
                        rag.append([k, a.dtype.str, list(a.shape), used, b""])
                    else:
                        rag.append([k, a.dtype.str, list(a.shape), -1, flat.tobytes()])
                    used += -(-flat.size // ALIGN) * ALIGN
                done.append([row, "", "", wrote, rag])
            except ItemError as exc:
                done.append([row, exc.reason, exc.detail, [], []])
            except Exception as exc:  # a kernel bug fails the item, never the agent
                done.append([row, "internal", f"{type(exc).__name__}: {exc}", [], []])
            seconds.append(time.perf_counter() - t0)
        return ["done", done, seconds, tally.cpu_ns, tally.wall_ns, tally.calls, used]


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    Worker(Link(sock)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
