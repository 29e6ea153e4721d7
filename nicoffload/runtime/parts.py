"""The host and GPU stages of the general path (`runtime.chain`; DPU stages: `dpu_part`). Each
turns the batches it is given into the same batches, finished, in order (`run(works, ctl)`).

`HostPart` runs a batch's rows on the worker pool; `GpuPart` runs whole batches through a
`GpuStage` and copies the values a later host or DPU stage reads down to the host.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import ItemError, SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import leaving, spec_of_key
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.batch import UNWRITTEN
from nicoffload.runtime.gpu_feed import placeholder
from nicoffload.runtime.gpu_feed import spec_of_key as value_spec
from nicoffload.runtime.stage import Stage
from nicoffload.runtime.work import Work, stage_reads


@dataclass
class Control:
    """One call's stop flag, and how a stage reports a failure that is not an item's."""

    stop: threading.Event
    fail: Callable[[BaseException], None]


class HostPart:
    """A host CPU stage: each live row through its bound kernels, on the worker pool."""

    def __init__(
        self, pipeline: Pipeline, plan: StagePlan, pool: ThreadPoolExecutor, workers: int
    ) -> None:
        keys = leaving(pipeline, plan)
        self.plan = plan
        self.stage = Stage(pipeline, plan, set(keys))
        self.reads = stage_reads(pipeline, plan.nodes)
        self.makes = {k: spec_of_key(pipeline, k) for k in keys}
        self.pool = pool
        self.chunks = 2 * max(1, workers)  # chunks per batch: the pool stays busy to its end

    def begin_call(self) -> None:
        self.stage.begin_call()

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        for w in works:
            for f, _ in self.submit(w, w.live()):
                f.result()  # an exception that is no item's is carried to the caller
            yield w

    def submit(self, w: Work, rows: list[int]) -> list[tuple[Future, int]]:
        """Run `rows` of `w` on the pool, in chunks: (future, rows in it) for each."""
        w.room(self.makes)
        size = max(1, -(-len(rows) // self.chunks))
        parts = [rows[i : i + size] for i in range(0, len(rows), size)]
        return [(self.pool.submit(self._rows, w, p), len(p)) for p in parts]

    def _rows(self, w: Work, rows: list[int]) -> None:
        for row in rows:
            values = w.row_values(row, self.reads)
            if values is None:
                continue
            dests = {k: w.arrays[k][row] for k in self.makes if k in w.arrays}
            try:
                self.stage.process(values, dests)
            except ItemError as exc:
                w.fail(row, exc.reason, exc.detail)
                continue
            for k in self.makes:
                if k in dests:
                    w.cols[k][row] = dests[k]  # written in place
                elif k in values:
                    w.put(k, row, values[k])


class GpuPart:
    """A GPU stage: whole batches through a `GpuStage` (or a stand-in with its interface).
    Its values stay on the GPU; those in `down` (read by a later host or DPU stage) are also
    copied to the host, once."""

    def __init__(
        self, pipeline: Pipeline, plan: StagePlan, stage: Any = None, down: set[str] = frozenset()
    ) -> None:
        self.keys = leaving(pipeline, plan)
        if stage is None:
            from nicoffload.runtime.gpu_stage import GpuStage

            stage = GpuStage(pipeline, plan, set(self.keys))
        self.plan, self.stage, self.down = plan, stage, set(down)
        self.specs = {k: value_spec(pipeline, k) for k in stage.inputs}

    def close(self) -> None:
        self.stage.close()

    def begin_call(self) -> None:
        self.stage.begin_call()

    def step_ms_per_item(self) -> dict[str, float]:
        return self.stage.step_ms_per_item()

    def run(self, works: Iterator[Work], ctl: Control) -> Iterator[Work]:
        fed: deque[Work] = deque()

        def batches() -> Iterator[Mapping[str, Any]]:
            for w in works:
                fed.append(w)
                yield self._inputs(w)

        run = self.stage.stream(batches())
        try:
            for gb in run:
                w = fed.popleft()
                self._take(w, gb)
                yield w
        finally:
            run.close()  # joins the stage's threads

    def _inputs(self, w: Work) -> dict[str, Any]:
        """The batch's `{input key: items}`: values made on the GPU as they are, host rows with
        a placeholder for each failed row."""
        out: dict[str, Any] = {}
        live = set(w.live())
        for k in self.stage.inputs:
            if k in w.dev:
                out[k] = w.dev[k]
                continue
            col = w.cols.get(k) or [None] * w.n
            rows = []
            for i, v in enumerate(col):
                if v is None and i in live:
                    w.fail(i, UNWRITTEN, f"no stage made '{k}' for this item (a runtime fault)")
                rows.append(v if v is not None and i in live else placeholder(self.specs[k]))
            out[k] = rows
        return out

    def _take(self, w: Work, gb: Any) -> None:
        if gb.n != w.n:
            raise SystemFailure(
                f"runtime: GPU stage '{self.plan.name}' returned {gb.n} rows for a batch of {w.n}"
            )
        for row, e in sorted(gb.failures.items()):
            w.fail(row, e.reason, e.detail)
        produced = getattr(gb, "produced", None)
        made = np.ones(w.n, bool) if produced is None else np.asarray(produced, bool)
        for k in self.keys:
            if k in gb.outputs:
                w.dev[k], w.made[k] = gb.outputs[k], made
        for k in self.down:
            if k in w.dev:
                rows = to_host(w.dev[k])
                w.cols[k] = [v if made[i] else None for i, v in enumerate(rows)]


def to_host(value: Any) -> list[Any]:
    """A GPU stage's batch value as host rows: a batch tensor copied down in one DMA into
    page-locked memory (rows are views of it), a list row by row (None stays None)."""
    if isinstance(value, list):
        return [None if v is None else _host_array(v) for v in value]
    if hasattr(value, "is_cuda"):
        import torch

        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value)
        return list(host.numpy())
    return list(np.asarray(value))


def _host_array(v: Any) -> np.ndarray:
    return v.cpu().numpy() if hasattr(v, "is_cuda") else np.asarray(v)
