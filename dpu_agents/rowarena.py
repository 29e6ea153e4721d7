"""Where a batch's outputs of varying shape (a decoded image of each row's own size) wait to be
sent: one buffer per batch slot, kept from batch to batch, its bytes taken from the agent's
ARENA budget.

Each row's output was copied out of its kernel's scratch buffer into a fresh array: at ImageNet
size (562 kB) 0.15-0.2 ms a row on the 2-core VM, a tenth of the agent's CPU for a decode-only
stage. A kernel that takes an allocator (`ops.Alloc`; the decoder) now writes its output here
directly (`alloc`), another's is copied here (`put`). Rows are views into it; every transport copies a batch out
before `send` returns (sockets, the shm ring, the RDMA staging buffer), so the buffer is free
again when the slot is taken for its next batch.

Sized by use: a batch that does not fit gets fresh arrays for its other rows (counted:
`fresh`), and its slot's buffer grows to what the batch needed when that slot is next taken,
within `most` bytes and what the budget has left; past either, rows keep getting fresh arrays
(counted the same way). Only an agent that runs its kernels in threads keeps them: with worker
processes the rows' outputs come out of the workers' own arenas (shared memory, the same ARENA
budget), which the row buffers would starve, and a copy out of those is needed anyway.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from dpu_agents.budget import ARENA

if TYPE_CHECKING:
    from dpu_agents.budget import Budget

ALIGN = 64  # each row starts on a cache line
_MIB = 1 << 20


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RowArena:
    """One batch slot's buffer for its rows of varying shape. `put` may be called from several
    worker threads of one batch at once; `reset` only when the slot is taken for a new batch
    (no view of the last one is read after that)."""

    def __init__(self, budget: Budget | None, most: int, initial: int = 0) -> None:
        """`initial`: bytes a typical batch's rows take (the stage's typical outputs): the
        buffer is made that size now, its pages touched, when the budget has them: a session's
        first batches then write into mapped memory, not fresh arrays (the first full call of
        a decode stage cost 1.5 ms/item against 0.75-0.97 later on the VM); the cost is the
        session's set-up."""
        self.budget, self.most = budget, most
        self.buf: np.ndarray | None = None
        self.used = self.want = 0  # bytes handed out this batch; what it asked for
        self.fresh = 0  # rows given a fresh array (over the buffer), since the arena was made
        self.closed = False
        self._lock = threading.Lock()
        size = min(-(-initial // _MIB) * _MIB, most)
        if size > 0 and (budget is None or budget.take(ARENA, size)):
            self.buf = np.zeros(size, np.uint8)  # zeros: every page written, so mapped, now

    @property
    def size(self) -> int:
        return 0 if self.buf is None else self.buf.size

    def reset(self) -> None:
        """A new batch: grow to what the last one asked for (within `most` and the budget);
        after `close` (a batcher that outlived its session's close), nothing is taken."""
        with self._lock:
            want, self.used, self.want = self.want, 0, 0
            if self.closed or want <= self.size or want > self.most:
                return
            size = min(-(-want // _MIB) * _MIB, self.most)
            if self.budget is not None and not self.budget.take(ARENA, size - self.size):
                return
            self.buf = np.empty(size, np.uint8)  # the old buffer's bytes go to the new one

    def alloc(self, shape: tuple[int, ...], dtype: object) -> np.ndarray:
        """An array of `shape` and `dtype` (uninitialised) valid until the next `reset`: an
        `ops.Alloc`, for a kernel that writes a row's output straight into the batch buffer."""
        dt = np.dtype(dtype)  # type: ignore[call-overload]
        nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        n = _aligned(nbytes)
        with self._lock:
            at = self.used
            self.want += n
            if self.buf is not None and at + n <= self.buf.size:
                self.used = at + n
                buf = self.buf
            else:
                buf = None
                self.fresh += 1
        if buf is None:
            return np.empty(shape, dt)
        return buf[at : at + nbytes].view(dt).reshape(shape)

    def put(self, value: object) -> np.ndarray:
        """A copy of `value` (an array) valid until the next `reset`."""
        a = np.asarray(value)
        out = self.alloc(a.shape, a.dtype)
        out[...] = a
        return out

    def close(self) -> None:
        """Give the buffer's bytes back to the budget (the session is closing); rows after
        this get fresh arrays."""
        with self._lock:
            if self.buf is not None and self.budget is not None:
                self.budget.give(ARENA, self.buf.size)
            self.buf, self.closed = None, True
