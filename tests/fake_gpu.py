"""A stand-in GpuStage without a GPU (numpy, the same interface as `GpuStage`), for tests of
the executor's GPU end on machines without CUDA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload import ops
from nicoffload.errors import ItemError


@dataclass
class FakeHostBatch:
    slot: Any
    arrays: list[np.ndarray]
    offsets: list[int]
    nbytes: int


@dataclass
class FakeGpuBatch:
    n: int
    outputs: dict[str, Any]
    failures: dict[int, ItemError]


class FakeRing:
    def __init__(self) -> None:
        self.given_back = 0

    def give_back(self, slot: Any) -> None:
        self.given_back += 1


class FakeGpuStage:
    """normalize on the host, a batch at a time; fails the items numbered in `fail`."""

    def __init__(self, pipeline, plan, fail: frozenset[int] = frozenset()) -> None:
        self.fail = fail
        node = pipeline.node("norm")
        self.fn = ops.get_kernel("normalize", "cpu").build([node], [])
        self.steps = [type("S", (), {"name": "norm"})()]
        self.inputs, self.outputs = ["crop"], ["norm"]
        self.ring = FakeRing()
        self.pinned_batches = 0
        self.closed = False

    def host_batch(self, shapes, dtype=np.uint8) -> FakeHostBatch:
        self.pinned_batches += 1
        arrays = [np.zeros(s, dtype) for s in shapes]
        return FakeHostBatch(
            object(), arrays, [i * arrays[0].nbytes for i in range(len(shapes))], 0
        )

    def stream(self, batches):
        start = 0
        for b in batches:
            crop = b["crop"]  # pinned rows (HostBatch), or the rows collected one by one
            rows = crop.arrays if hasattr(crop, "arrays") else crop
            out = np.stack([np.array(self.fn(r), copy=True) for r in rows])
            bad = {
                i: ItemError("gpu_says_no", "row")
                for i in range(len(rows))
                if start + i in self.fail
            }
            start += len(rows)
            yield FakeGpuBatch(len(rows), {"norm": out}, bad)

    def begin_call(self) -> None:
        pass

    def step_ms_per_item(self) -> dict[str, float]:
        return {"norm": 0.001}

    def close(self) -> None:
        self.closed = True
