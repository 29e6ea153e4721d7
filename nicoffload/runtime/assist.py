"""Host assist at run time: how many rows of each batch the host runs a plan's leading DPU
stage for, while the agent is busy (`planner.assist` decides the plan's share).

The plan's share is where the controller starts; it then follows what the host keeps up with:
a batch closed while the host has none of its assisted rows left raises the share a step (the
host was idle), one closed while the host still has more than that batch's share to do lowers
it (the host falls behind, and the agent's rows would wait behind its own). An agent that holds
less than a batch is not busy: the batch goes to it whole. At most `ROOM` batches' rows are
assisted at once, and the executor's queue has room for them beside its own bound (the
feeder can still wait on it while the agent's rows fill it; never for ever: workers drain it).
"""

from __future__ import annotations

import threading

from nicoffload.planner.assist import SHARE_MAX, SHARE_MIN

STEP = 0.05  # the share's change per batch
LOW, HIGH = SHARE_MIN, SHARE_MAX  # the share stays within (neither side idle for long)
ROOM = 3  # batches' rows assisted at once
# batch slots the executor adds: a batch whose rows the host shares is done when both parts
# are, and batches come out in order, so the agent keeps working on later ones meanwhile
EXTRA_SLOTS = 8  # H200, 8+8 cores: 4 gave 1.05-1.15x all-host, 10 1.14-1.19x, 16 worse


class HostAssist:
    """The share of rows the host takes, adapted batch by batch; thread-safe."""

    def __init__(self, share: float, batch_size: int) -> None:
        self.start = min(HIGH, max(LOW, share))
        self.share = self.start
        self.batch_size = batch_size
        self.room = ROOM * batch_size
        self.extra_slots = EXTRA_SLOTS
        self.outstanding = 0  # assisted rows not finished yet
        self.taken = 0  # rows taken in this call
        self._owed = 0.0  # the share of rows so far, less those taken
        self._lock = threading.Lock()

    def take(self, rows: int, agent_holds: int, host_queued: int, workers: int) -> int:
        """How many of a closed batch's `rows` the host runs: `agent_holds` rows are at the
        agent, `host_queued` tasks wait in the host's queue for `workers` workers."""
        if agent_holds < self.batch_size:
            return 0  # the agent is not busy: it takes the batch
        with self._lock:
            if host_queued > workers + self.outstanding:
                return 0  # the host is busy with the agent's rows: they come first
            if self.outstanding == 0:
                self.share = min(HIGH, self.share + STEP)
            elif self.outstanding > self.share * rows:
                self.share = max(LOW, self.share - STEP)
            self._owed += self.share * rows
            k = max(0, min(int(self._owed), rows, self.room - self.outstanding))
            self._owed = min(self._owed - k, 1.0)  # a fraction carried: batches of one row
            self.outstanding += k
            self.taken += k
            return k

    def begin_call(self) -> None:
        """A new call: the rows of an earlier one (finished, or abandoned with rows dropped
        unfinished) are no longer counted; the share learnt so far is kept."""
        with self._lock:
            self.outstanding, self._owed, self.taken = 0, 0.0, 0

    def done(self, n: int = 1) -> None:
        """`n` assisted rows are finished (ok or failed)."""
        with self._lock:  # a straggler of an earlier call counts for nothing
            self.outstanding = max(0, self.outstanding - n)
