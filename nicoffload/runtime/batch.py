"""A finished batch and the row status that decides which of its rows are ok.

Every place a row's result lands (an output array of the batch slot, a ragged output, an input
row of the GPU stage) is a *sink*. Whatever writes a row into a sink stamps it with the item's
index; a row is ok only when it did not fail and every sink holds its own item's stamp. So a row
that no stage wrote, or one overwritten by another batch's item (a slot reused too early), can
never come out as ok: it becomes an item error (`unwritten`) that says which sink was missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

UNWRITTEN = "unwritten"  # the reason of a row that no stage wrote: a runtime fault, never ok
# Rows the DPU agent did not run, which the host then runs itself (never item errors):
DRAINING = "agent_draining"  # the agent refused it: it shuts down
SLOT_OVERFLOW = "slot_overflow"  # its outputs did not fit the receiver's slot beside its batch
WORKER_LOST = "agent_worker_lost"  # the agent's worker process running it died (it restarts)
ON_HOST = (DRAINING, SLOT_OVERFLOW, WORKER_LOST)


@dataclass(frozen=True)
class ItemFailure:
    index: int
    name: str
    reason: str
    detail: str


@dataclass
class Batch:
    """A finished batch. Arrays are views into a reused slot: valid until the next batch is taken.
    Outputs of a GPU stage are CUDA tensors (`numpy()` gives a copy with host arrays)."""

    index: int
    start: int  # index of the first item in the run
    names: list[str]
    outputs: dict[str, Any]  # static outputs: arrays (n, ...); ragged ones: lists
    ok: np.ndarray
    failures: list[ItemFailure]
    latencies_s: np.ndarray
    # per-row perf_counter stamps, where the executor keeps them (serving's breakdown):
    # admitted, closed (sent to the agent), delivered (back from it; 0: not), finished, done
    row_times: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.names)

    def numpy(self) -> Batch:
        """The same batch with every output on the host (CUDA tensors copied, once)."""

        def host(v: Any) -> Any:
            if isinstance(v, list):
                return [None if x is None else host(x) for x in v]
            return v.cpu().numpy() if hasattr(v, "cpu") else v

        return replace(self, outputs={k: host(v) for k, v in self.outputs.items()})


class Stamps:
    """Per sink, which item wrote each row (item index + 1; 0: nothing yet)."""

    def __init__(self, sinks: Iterable[str], rows: int) -> None:
        self.rows = {k: np.zeros(rows, np.int64) for k in sinks}

    def reset(self) -> None:
        for a in self.rows.values():
            a[:] = 0

    def wrote(self, sink: str, row: int, index: int) -> None:
        self.rows[sink][row] = index + 1

    def missing(self, n: int, start: int) -> dict[int, list[str]]:
        """Rows among the first `n` (stamp keys `start`...) whose sinks lack their item's."""
        want = np.arange(start + 1, start + n + 1)
        out: dict[int, list[str]] = {}
        for sink, a in self.rows.items():
            for row in np.flatnonzero(a[:n] != want).tolist():
                out.setdefault(row, []).append(sink)
        return out


def settle(
    start: int,
    names: list[str],
    failures: list[ItemFailure],
    stamps: Iterable[Stamps],
    key: int = 0,
) -> tuple[np.ndarray, list[ItemFailure]]:
    """The batch's `ok` rows and its failures, sorted: a row that did not fail but whose sinks
    were not all written by its own item (stamped `key + index`) fails as `unwritten`."""
    n = len(names)
    ok = np.ones(n, dtype=bool)
    for f in failures:
        ok[f.index - start] = False
    missing: dict[int, list[str]] = {}
    for s in stamps:
        for row, sinks in s.missing(n, key + start).items():
            missing.setdefault(row, []).extend(sinks)
    more = [
        ItemFailure(
            start + row,
            names[row],
            UNWRITTEN,
            f"no stage wrote {', '.join(sorted(sinks))} for this item (a runtime fault; the "
            "row is not returned)",
        )
        for row, sinks in sorted(missing.items())
        if ok[row]
    ]
    for f in more:
        ok[f.index - start] = False
    return ok, sorted(failures + more, key=lambda f: f.index)
