"""A batch on the general path (`runtime.chain`): its values by value key as the stages make
them, and its row status (a failed row fails alone, with the first reason it got).

Host values are kept per row (`cols`), the static ones written in place into one (n, ...)
array per key (`arrays`); a GPU stage's values stay on the GPU as it made them (`dev`: a
batch tensor or a list of tensors), with the rows it produced (`made`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.graph import Pipeline, TensorSpec
from nicoffload.runtime.batch import UNWRITTEN, ItemFailure
from nicoffload.runtime.gpu_direct import Taken


def stage_reads(pipeline: Pipeline, nodes: Iterable[str]) -> list[str]:
    """Value keys the nodes read that they do not make themselves (earlier stages' values and
    the pipeline's inputs), in order."""
    inside = set(nodes)
    keys = (str(r) for n in inside for r in pipeline.node(n).inputs)
    return sorted({k for k in keys if k.split(".", 1)[0] not in inside})


@dataclass
class Work:
    """One batch: `taken` (its items as ingress cut them) and what the stages made of it."""

    taken: Taken
    cols: dict[str, list[Any]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    dev: dict[str, Any] = field(default_factory=dict)
    made: dict[str, np.ndarray] = field(default_factory=dict)
    failed: dict[int, ItemFailure] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.cols.update(self.taken.values)  # the pipeline's inputs, as ingress took them

    @property
    def n(self) -> int:
        return len(self.taken.names)

    def fail(self, row: int, reason: str, detail: str) -> None:
        """Row `row` fails (its first failure is the one reported)."""
        with self.lock:
            if row not in self.failed:
                t = self.taken
                self.failed[row] = ItemFailure(t.start + row, t.names[row], reason, detail)

    def live(self) -> list[int]:
        """The rows not failed so far."""
        with self.lock:
            return [r for r in range(self.n) if r not in self.failed]

    def room(self, specs: dict[str, TensorSpec]) -> None:
        """Room for values a stage is about to make: a row list per key, and one array per
        static key that rows are written into in place. Made before any row is written (the
        writers then only set rows)."""
        for key, spec in specs.items():
            self.cols.setdefault(key, [None] * self.n)
            if spec.static and key not in self.arrays:
                self.arrays[key] = np.empty((self.n, *spec.shape), spec.dtype)

    def put(self, key: str, row: int, value: Any) -> None:
        """A row's value, copied (a kernel's result may be a view of per-thread scratch; a
        delivery's, of a receiver slot that is given back)."""
        a = self.arrays.get(key)
        if a is not None:
            a[row] = value
            self.cols[key][row] = a[row]
        else:
            self.cols[key][row] = (
                np.array(value, copy=True) if isinstance(value, np.ndarray) else value
            )

    def row_values(self, row: int, keys: Iterable[str]) -> dict[str, Any] | None:
        """The row's values of `keys`; None (and the row failed as unwritten) when a stage
        before left one of them unmade."""
        out = {}
        for k in keys:
            col = self.cols.get(k)
            v = None if col is None else col[row]
            if v is None:
                self.fail(row, UNWRITTEN, f"no stage made '{k}' for this item (a runtime fault)")
                return None
            out[k] = v
        return out
