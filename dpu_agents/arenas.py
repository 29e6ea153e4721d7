"""A worker process's two shared-memory arenas (its rows' inputs; their outputs of varying shape),
bounded and counted in the agent's memory budget (ARENA), as the agent's pool thread for that
worker grows, hands over and trims them (`procs`)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_agents.budget import ARENA
from dpu_agents.config import AgentConfig
from nicoffload.errors import TransportError
from nicoffload.transport.shm import Segment

if TYPE_CHECKING:
    from dpu_agents.budget import Budget


class WorkerGone(Exception):
    """The worker process exited (or stopped answering) during a call."""


IN, OUT = 0, 1  # a worker's arenas: its rows' inputs; their outputs of varying shape
FLOOR = 64 << 10  # the smallest arena
_MIB = 1 << 20


class Arenas:
    """A worker's two arenas, each one shared-memory segment (or none yet) that grows to what a
    chunk needs: never past `most` bytes nor past what the agent's budget (ARENA, whose bytes
    it holds) has left; `trim` gives back one over `keep` bytes once its chunk is done. Used
    by the worker's pool thread only."""

    def __init__(self) -> None:
        self.segs: list[Segment | None] = [None, None]
        self.budget: Budget | None = None
        self.most, self.keep = AgentConfig.max_arena_bytes, AgentConfig.arena_keep_bytes

    def use(self, budget: Budget | None) -> None:
        """Count the arenas in `budget` (the agent's: the same one at every call), within its
        limits."""
        if budget is None or budget is self.budget:
            return
        self.close()  # what the previous budget held goes back to it
        self.budget, self.most, self.keep = budget, budget.arena_most, budget.arena_keep

    def size(self, which: int) -> int:
        seg = self.segs[which]
        return 0 if seg is None or seg.array is None else seg.array.size

    def array(self, which: int) -> np.ndarray | None:
        seg = self.segs[which]
        return None if seg is None else seg.array

    def where(self, which: int) -> list[Any]:
        """[name, size] as a worker attaches it; ["", 0] for none."""
        seg = self.segs[which]
        return ["", 0] if seg is None else [seg.name, self.size(which)]

    def fit(self, which: int, n: int) -> bool:
        """Whether arena `which` holds n bytes now, grown if need be (what it held is lost:
        callers grow it empty); False over `most` or past the budget's room (`why` says which).
        WorkerGone when shared memory has no room for it."""
        n, have = max(n, 1), self.size(which)
        if n <= have:
            return True
        if n > self.most:
            return False
        size = min(_arena_size(n, self.keep), self.most)
        if self.budget is not None and not self.budget.take(ARENA, size - have):
            return False
        self._close(which, give=False)  # its bytes stay taken, as part of the new one's
        name = f"nicoffload-{('in', 'out')[which]}-{secrets.token_hex(8)}"
        try:
            self.segs[which] = Segment(name, size, create=True)
        except TransportError as exc:
            if self.budget is not None:
                self.budget.give(ARENA, size)
            raise WorkerGone(str(exc)) from None
        return True

    def why(self, which: int, n: int) -> str:
        """Why `fit(which, n)` said no."""
        what = ("inputs", "outputs of varying shape")[which]
        if n > self.most:
            return f"its {what} take {n} bytes, more than the agent's max_arena_bytes ({self.most})"
        total = self.budget.total[ARENA] if self.budget is not None else 0
        return f"the agent's arena_bytes ({total}) has no room now for its {what} ({n} bytes)"

    def trim(self) -> None:
        """Give back an arena over `keep` bytes (its chunk is done; the worker let it go too)."""
        for which in (IN, OUT):
            if self.size(which) > self.keep:
                self._close(which)

    def _close(self, which: int, give: bool = True) -> None:
        seg, n = self.segs[which], self.size(which)
        if seg is None:
            return
        seg.close()
        self.segs[which] = None
        if give and self.budget is not None:
            self.budget.give(ARENA, n)

    def close(self) -> None:
        for which in (IN, OUT):
            self._close(which)


def _arena_size(n: int, keep: int) -> int:
    """A power of two (few regrowths) while it may be kept between chunks; else n in whole MiB
    (it goes after its chunk: no more than it needs)."""
    size = 1 << (max(n, FLOOR) - 1).bit_length()
    return size if size <= keep else -(-n // _MIB) * _MIB
