"""One of the agent's worker processes (`python -m dpu_agents.worker FD AGENT_PID`): it builds
each loaded stage as LOAD did (`build_stage`, the same text), and runs the rows the agent gives
it, reading their values from an input arena and writing their outputs straight into the batch
slot (those of varying shape into an output arena), all shared memory the agent made (mode 600,
checked on attach). Messages are msgpack over the socket FD (`link.Link`); nothing is
unpickled.

The agent runs one such process per core so that its kernels run in parallel without sharing a
GIL: with threads, the GIL taken back after every kernel call capped an 8-core agent at about
5.7 cores' worth (bench/RESULTS.md). It ignores SIGINT and SIGTERM (the agent drains, then closes
the socket) and exits when the socket closes, or is killed when the agent dies (`die_with`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

import numpy as np

from dpu_agents.config import AgentConfig
from dpu_agents.link import BYTES, TEXT, Link
from dpu_agents.sharedslots import slot_views
from dpu_agents.stagebuild import Built, build_stage
from nicoffload.errors import ItemError
from nicoffload.transport.shm import Segment
from nicoffload.transport.slots import ALIGN

PR_SET_PDEATHSIG = 1  # linux/prctl.h
DETAIL_CHARS = 1000  # of a failed row's detail: a reply stays far inside link.MAX_MESSAGE


class Hangup(Exception):
    """The agent is gone, or broke the exchange: the worker exits."""


class Worker:
    def __init__(self, link: Link) -> None:
        self.link = link
        self.stages: dict[int, tuple[Built, Segment, list[dict[str, np.ndarray]]]] = {}
        self.arena: Segment | None = None
        self.out: Segment | None = None

    def serve(self) -> None:
        try:
            self.link.send(["ready"])
            while True:
                self.link.send(self._answer(self.link.recv()))
        except (EOFError, OSError, Hangup):
            return

    def _answer(self, msg: list[Any]) -> list[Any]:
        try:
            return getattr(self, f"_{msg[0]}")(*msg[1:])
        except Hangup:
            raise
        except Exception as exc:  # a bad message or a failed build: the agent is told
            return ["error", f"{type(exc).__name__}: {exc}"]

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

    def _run(
        self, key: int, slot: int, arena: list[Any], out: list[Any], keep: int, rows: list[Any]
    ) -> list[Any]:
        """The rows' values from the input arena; their outputs of varying shape into the output
        arena, which the agent empties (and grows) when the next row's do not fit: ["flush",
        the rows so far, the bytes the next needs], answered ["go", the arena] or ["skip",
        reason, detail] (that row fails, for the host to run). An arena over `keep` bytes is
        let go after the rows (the agent gives it back)."""
        self.arena = _attach(self.arena, *arena)
        self.out = _attach(self.out, *out)
        built, _, slots = self.stages[key]
        stage, arrays = built.stage, slots[slot]
        assert self.arena is not None and self.arena.array is not None
        buf = self.arena.array
        ragged = [k for k, s in built.out_specs.items() if not s.static]
        tally = stage.tally()
        done: list[Any] = []
        seconds: list[float] = []
        used = 0
        try:
            for row, where in rows:
                t0 = time.perf_counter()
                result, outs = self._row(stage, arrays, row, _values(buf, where), ragged, tally)
                if outs:
                    need = sum(_aligned(a.nbytes) for a in outs)
                    if used + need > _size(self.out):
                        answer = self._flush(done, need)
                        done, used = [], 0
                        if answer[0] == "skip":
                            result, outs = [row, answer[1], answer[2], [], []], []
                    used = self._place(outs, ragged, used, result[4])
                done.append(result)
                seconds.append(time.perf_counter() - t0)
        finally:
            if _size(self.arena) > keep:
                self.arena = _attach(self.arena, "", 0)
            if _size(self.out) > keep:
                self.out = _attach(self.out, "", 0)
        return ["done", done, seconds, tally.cpu_ns, tally.wall_ns, tally.calls]

    def _place(self, outs: list[np.ndarray], ragged: list[str], used: int, into: list) -> int:
        """The row's outputs of varying shape into the output arena from `used` on (room was
        made); where each lies goes `into` its result. Returns the bytes now used."""
        room = self.out.array if self.out is not None else None
        for k, a in zip(ragged, outs, strict=False):  # none when the row failed
            flat = a.reshape(-1).view(np.uint8)
            if flat.size:
                assert room is not None and used + flat.size <= room.size
                room[used : used + flat.size] = flat
            into.append([k, a.dtype.str, list(a.shape), used])
            used += _aligned(flat.size)
        return used

    @staticmethod
    def _row(
        stage: Any, arrays: dict[str, np.ndarray], row: int, values: dict, ragged: list, tally: Any
    ) -> tuple[list[Any], list[np.ndarray]]:
        """One row run: its result, and its outputs of varying shape (to be placed)."""
        try:
            written = stage.process(values, {k: a[row] for k, a in arrays.items()}, tally)
            wrote = []
            for k, a in arrays.items():
                if k in values:  # else unstamped: the row is sent as failed
                    if k not in written:
                        a[row] = values[k]
                    wrote.append(k)
            outs = [np.ascontiguousarray(values[k]) for k in ragged]
            return [row, "", "", wrote, []], outs
        except ItemError as exc:
            return [row, exc.reason, exc.detail[:DETAIL_CHARS], [], []], []
        except Exception as exc:  # a kernel bug fails the item, never the agent
            return [row, "internal", f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS], [], []], []

    def _flush(self, done: list[Any], need: int) -> list[Any]:
        """The agent copies out the rows so far and makes room for `need` bytes (or says no)."""
        try:
            self.link.send(["flush", done, need])
            answer = self.link.recv()
        except (EOFError, OSError) as exc:
            raise Hangup(str(exc)) from None
        if answer[0] == "go":
            self.out = _attach(self.out, *answer[1])
        elif answer[0] != "skip":
            raise Hangup(f"answered {answer[0]!r} to a flush")
        return answer


def _attach(have: Segment | None, name: str, size: int) -> Segment | None:
    """The arena the agent names (None for ""), `have` if it is that one."""
    if have is not None and have.name == name:
        return have
    if have is not None:
        have.close()
    return Segment(name, size, create=False) if name else None


def _size(seg: Segment | None) -> int:
    return 0 if seg is None or seg.array is None else seg.array.size


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _values(buf: np.ndarray, where: list[Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for k, kind, off, n, dtype, shape in where:
        part = buf[off : off + n]
        if kind == BYTES:
            values[k] = memoryview(part)
        elif kind == TEXT:
            values[k] = part.tobytes().decode("utf-8", "surrogatepass")  # as it was sent
        else:
            values[k] = part.view(dtype).reshape(shape)
    return values


def die_with(agent: int) -> None:
    """Be SIGKILLed when the agent's process dies (PDEATHSIG: a stopped worker never reads its
    socket's end, and SIGKILL reaches it), and exit now if it died before that was set. The
    signal fires when the agent's *thread* that forked this process exits: the agent forks every
    worker from one thread that lives as long as its pool (`procs.Spawner`). Linux only; on
    other systems only the check."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != agent:
        sys.exit(1)


def main(argv: list[str]) -> int:
    die_with(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    Worker(Link(sock)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
