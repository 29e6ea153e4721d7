"""The general path: a plan of any stage sequence, run batch by batch.

A batch is formed once at ingress and passes through the plan's stages in order, one thread per
stage, so stage k works on batch i while stage k-1 works on batch i+1 (`runtime.parts`: host
rows on the worker pool, whole batches on the GPU, a REQUEST frame per batch to a DPU agent).
A stage reads the values, by value key, that any earlier stage or the pipeline's inputs made.
The executor's fast paths keep the shapes they were tuned for ([a DPU stage] -> host stages ->
[a GPU stage]); `executor_for` picks the fast path where it applies and this one elsewhere.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, PlanError, SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.planner.physical import host_share, ring_slots
from nicoffload.planner.plan import Plan, StagePlan
from nicoffload.runtime.batch import Batch, Stamps, settle
from nicoffload.runtime.buffers import drain as drain_until
from nicoffload.runtime.buffers import put_unless
from nicoffload.runtime.dpu_part import DpuPart
from nicoffload.runtime.executor import Executor
from nicoffload.runtime.gpu_direct import Ingress
from nicoffload.runtime.gpu_feed import zero_failed
from nicoffload.runtime.parts import Control, GpuPart, HostPart
from nicoffload.runtime.remote import RemoteFront
from nicoffload.runtime.stage import StepTime, split_stages
from nicoffload.runtime.work import Work, stage_reads

Item = tuple[str, Mapping[str, Any]]
_END = object()
DEPTH = 2  # batches waiting between two stages


def fast_path(plan: Plan) -> bool:
    """Whether the executor's fast path runs this plan: [a DPU stage] -> host -> [a GPU stage]."""
    try:
        split_stages(plan)
    except DeviceError:
        return False
    return True


def executor_for(
    pipeline: Pipeline,
    plan: Plan,
    *,
    workers: int | None = None,
    fronts: Mapping[str, RemoteFront] | None = None,
    gpu_stages: Mapping[str, Any] | None = None,
) -> Executor | Chain:
    """What runs `plan`: the fast path for its shapes, the general path for every other.
    `fronts`: the agent front of each DPU stage, by stage name; `gpu_stages`: a stand-in for
    a GPU stage's `GpuStage`, by stage name (tests)."""
    fronts = fronts or {}
    if fast_path(plan):
        first = plan.stages[0]
        gpu = next(iter((gpu_stages or {}).values()), None)
        return Executor(
            pipeline, plan, workers=workers, front=fronts.get(first.name), gpu_stage=gpu
        )
    return Chain(pipeline, plan, workers=workers, fronts=fronts, gpu_stages=gpu_stages)


@dataclass
class _View:
    """What `report.finish_stats` reads of an executor, for one part of a chain."""

    plan: Plan
    failed_over: str | None = None
    taken_back: int = 0
    gpu: Any = None
    times: list[tuple[StagePlan, dict[str, StepTime]]] = field(default_factory=list)

    def step_times(self) -> list[tuple[StagePlan, dict[str, StepTime]]]:
        return self.times


class Chain:
    """Runs a plan of any stage sequence. A context manager; `stream(items)` yields Batches in
    order. DPU stages are served by `fronts` (one per stage, by stage name), GPU stages by a
    `GpuStage` each (`gpu_stages` stands in for them in tests)."""

    def __init__(
        self,
        pipeline: Pipeline,
        plan: Plan,
        *,
        workers: int | None = None,
        fronts: Mapping[str, RemoteFront] | None = None,
        gpu_stages: Mapping[str, Any] | None = None,
    ) -> None:
        plan.check_matches(pipeline)
        if any(host_share(plan, st) for st in plan.stages):
            raise PlanError(
                "host assist is run for a plan of [a DPU stage] -> host stages -> [a GPU "
                f"stage] only; this plan's stages are {', '.join(s.device for s in plan.stages)}"
            )
        self.pipeline, self.plan = pipeline, plan
        self.batch_size = pipeline.batch_max_size
        self.max_wait_s = pipeline.batch_max_wait_ms / 1000
        self.workers = workers or len(os.sched_getaffinity(0))
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="nicoffload-worker")
        self.gpu = None  # no single GPU end: `report` reads each GPU stage through `_View`
        self.parts: list[Any] = []
        try:
            for i, st in enumerate(plan.stages):
                self.parts.append(self._part(st, plan.stages[i + 1 :], fronts or {}, gpu_stages))
        except BaseException:
            self.close()
            raise
        self.out_refs = {name: str(ref) for name, ref in pipeline.outputs.items()}
        self.specs = pipeline.output_specs()

    def _part(self, st: StagePlan, later, fronts, gpu_stages) -> Any:
        if st.kind == "cpu":
            return HostPart(self.pipeline, st, self.pool, self.workers)
        if st.kind == "gpu":
            off_gpu = [s for s in later if s.kind != "gpu"]
            down = {k for s in off_gpu for k in stage_reads(self.pipeline, s.nodes)}
            stand_in = (gpu_stages or {}).get(st.name)
            return GpuPart(self.pipeline, st, stand_in, down)
        if st.kind == "dpu":
            front = fronts.get(st.name)
            if front is None:
                raise DeviceError(f"stage '{st.name}' needs a DPU agent for '{st.device}'")
            return DpuPart(
                self.pipeline, st, front, self.pool, self.workers, ring_slots(self.plan, st)
            )
        raise DeviceError(f"stage '{st.name}': no runtime for device kind '{st.kind}'")

    @property
    def dpu_parts(self) -> list[DpuPart]:
        return [p for p in self.parts if isinstance(p, DpuPart)]

    @property
    def failed_over(self) -> str | None:
        """Why the first DPU stage that failed over sent its rows to the host."""
        return next((p.failed_over for p in self.dpu_parts if p.failed_over), None)

    @property
    def taken_back(self) -> int:
        return sum(p.taken_back for p in self.dpu_parts)

    def begin_call(self) -> None:
        for p in self.parts:
            p.begin_call()

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for p in self.parts:
            if isinstance(p, GpuPart):
                p.close()

    def stream(self, items: Iterable[Item]) -> Iterator[Batch]:
        """Process `items`; yield finished batches in order. A stage's crash is re-raised here
        (the items iterator's own exception as it is)."""
        stop = threading.Event()
        failure: list[BaseException] = []

        def fail(exc: BaseException) -> None:
            failure.append(exc)
            stop.set()

        ctl = Control(stop, fail)
        ingress = Ingress(items, self.batch_size, self.max_wait_s, list(self.pipeline.inputs))
        links = [queue.Queue(maxsize=DEPTH) for _ in range(len(self.parts) + 1)]

        def drain(q: queue.Queue) -> Iterator[Any]:
            return drain_until(q, stop, _END)

        def feed() -> None:
            try:
                for t in ingress:
                    if not put_unless(links[0], Work(t), stop):
                        return
            except BaseException as exc:
                fail(exc)
            put_unless(links[0], _END, stop)

        def stage(i: int) -> None:
            try:
                for w in self.parts[i].run(drain(links[i]), ctl):
                    if not put_unless(links[i + 1], w, stop):
                        return
            except BaseException as exc:
                fail(exc)
            put_unless(links[i + 1], _END, stop)

        threads = [threading.Thread(target=feed, name="nicoffload-feed", daemon=True)]
        threads += [
            threading.Thread(target=stage, args=(i,), name=f"nicoffload-{p.plan.name}", daemon=True)
            for i, p in enumerate(self.parts)
        ]
        for t in threads:
            t.start()
        try:
            for w in drain(links[-1]):
                yield self._batch(w)
            if failure:
                raise SystemFailure(f"runtime: a stage failed: {failure[0]!r}") from failure[0]
            if ingress.error is not None:
                raise ingress.error
        finally:
            stop.set()
            ingress.stop()
            for t in threads:
                t.join(timeout=5.0)
            for p in self.dpu_parts:
                p.front.forget()  # a late result of this call is ignored

    def _batch(self, w: Work) -> Batch:
        """The finished Batch: a row is ok when no stage failed it and every output holds its
        own item's value (`batch.settle`); failed rows are zeros (None in lists)."""
        t, n = w.taken, w.n
        stamps = Stamps(self.out_refs, n)
        want = t.start + np.arange(n) + 1
        outputs: dict[str, Any] = {}
        used: set[str] = set()
        for name, ref in self.out_refs.items():
            if ref in w.dev:  # made on the GPU: handed over as it is (CUDA tensors)
                stamps.rows[name][w.made[ref]] = want[w.made[ref]]
                v = w.dev[ref]
                outputs[name] = list(v) if isinstance(v, list) else v
                continue
            col = w.cols.get(ref) or [None] * n
            there = np.fromiter((v is not None for v in col), bool, n)
            stamps.rows[name][there] = want[there]
            if self.specs[name].static:
                a = w.arrays.get(ref)
                if a is None or ref in used:
                    spec = self.specs[name]
                    a = np.zeros((n, *spec.shape), spec.dtype)
                    for i in np.flatnonzero(there).tolist():
                        a[i] = col[i]
                used.add(ref)
                outputs[name] = a
            else:
                outputs[name] = list(col)
        failures = [w.failed[r] for r in sorted(w.failed)]
        ok, failures = settle(t.start, t.names, failures, [stamps])
        if not ok.all():
            for v in outputs.values():
                if isinstance(v, np.ndarray):
                    v[~ok] = 0
            zero_failed({k: v for k, v in outputs.items() if not isinstance(v, np.ndarray)}, ok)
        lat = time.perf_counter() - t.admitted
        return Batch(t.index, t.start, list(t.names), outputs, ok, failures, lat)

    def step_times(self) -> list[tuple[StagePlan, dict[str, StepTime]]]:
        """What each host stage's steps cost per item; a DPU stage's host copy only once it has
        run rows taken back from its agent."""
        out = []
        for p in self.parts:
            if isinstance(p, HostPart):
                out.append((p.plan, p.stage.times()))
            elif isinstance(p, DpuPart):
                times = p.fallback.stage.times()
                if any(x.calls for x in times.values()):
                    out.append((p.fallback.plan, times))
        return out

    def report(self, stats: Any) -> None:
        """Fill a call's per-stage and per-transfer figures (`report.finish_stats`) for every
        stage: each DPU stage with its front, the host stages, each GPU stage."""
        from nicoffload.report import finish_stats

        why = []
        for p in self.dpu_parts:
            stats.failover = None
            finish_stats(stats, _View(self.plan, p.failed_over, p.taken_back), p.front)
            if stats.failover:
                why.append(stats.failover)
        stats.failover = "; ".join(why) or None
        finish_stats(stats, _View(self.plan, times=self.step_times()), None)
        for p in self.parts:
            if isinstance(p, GpuPart):
                finish_stats(stats, _View(self.plan, gpu=p), None)
