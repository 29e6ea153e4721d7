"""A Session: a pipeline opened once (planned, its agents started or attached, its DPU stages
loaded, their receivers listening, its kernels bound) that then serves many calls.

    with nicoffload.open("pipelines/resnet50.yaml") as s:
        for batch in s.stream(items): ...      # batches as they complete
        result = s.run(more_items)             # a RunResult
        future = s.submit(even_more)           # a Future of a RunResult, for serving loops

`nicoffload.run` is one call on a session of its own. Setting up is reported on its own
(`setup_s`), never in a call's per-item figures.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sized
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from nicoffload.errors import SystemFailure
from nicoffload.graph import Pipeline
from nicoffload.inputs import values_items
from nicoffload.planner.plan import Plan
from nicoffload.report import finish_stats
from nicoffload.runner import Prepared, RunResult, RunStats, open_fronts, prepare
from nicoffload.runtime.chain import Chain, executor_for
from nicoffload.runtime.executor import Batch


class SessionClosed(SystemFailure):
    """The session was closed before (or while) a call ran."""


def _host_share(prep: Prepared) -> contextlib.AbstractContextManager[Any]:
    """Where the topology emulates a DPU on this machine's cores and the plan starts no agent on
    them (all on the host, or on the host and a GPU), the host's threads keep to the host's
    share of the cores all the same, as the planner counts them (`local_topology`) and as they
    do beside a running agent (`remote.cores_apart`; the agent takes the first cores)."""
    import os

    from nicoffload.runtime.remote import cores_apart

    topo = prep.topology
    if topo is None or not hasattr(os, "sched_getaffinity"):
        return contextlib.nullcontext()
    emulated = [d for d in topo.devices if d.emulated]
    if not emulated or any(topo.device(s.device).emulated for s in prep.plan.stages):
        return contextlib.nullcontext()  # none, or its agent's front keeps the host apart
    return cores_apart(sorted(os.sched_getaffinity(0))[: sum(d.cores for d in emulated)])


class Session:
    """An open pipeline. Calls run one at a time, in the order they are made (`submit` queues
    them); each call's items are numbered from 0 in its own RunResult."""

    def __init__(self, prep: Prepared, *, workers: int | None = None) -> None:
        self.prep = prep
        if workers is None and prep.topology is not None and "cpu" in prep.topology.ids:
            # the host's share of the cores: an emulated DPU's agent is pinned to the others
            workers = prep.topology.device("cpu").cores
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()  # one call at a time
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._cancel = threading.Event()
        self._active: Iterator[Batch] | None = None  # the latest stream() generator
        self._active_thread = 0  # the thread that made it
        self._staging = Staging()  # page-locked memory GPU outputs come down through, kept
        t0 = time.perf_counter()
        try:
            # one front per DPU stage, opened once and reused by every call
            self.fronts = self._stack.enter_context(open_fronts(prep))
            self._stack.enter_context(_host_share(prep))
            self.front = self.fronts.get(prep.plan.stages[0].name)  # the leading DPU stage's
            self.executor = self._stack.enter_context(
                executor_for(prep.pipeline, prep.plan, workers=workers, fronts=self.fronts)
            )
        except BaseException:
            self._stack.close()
            raise
        self.setup_s = time.perf_counter() - t0  # planning excluded: that is `prepare`'s

    @property
    def pipeline(self) -> Pipeline:
        return self.prep.pipeline

    @property
    def plan(self) -> Plan:
        return self.prep.plan

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop: a call in flight ends early and raises SessionClosed, queued calls are
        cancelled; then the agent, the receiver and the executor are closed."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        if self._active is not None:
            # a stream left suspended (in this thread) ends here; one running in another
            # thread (ValueError) sees the cancel and ends
            with contextlib.suppress(ValueError):
                self._active.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # the call in flight has stopped
            self._stack.close()

    def stream(self, items: Iterable[Any], stats: RunStats | None = None) -> Iterator[Batch]:
        """Run `items` and yield their batches in order as they complete; `stats` (optional) is
        filled as the call goes and complete at its end. Items: as for `run`. A batch's arrays
        are views into a reused slot, valid until the next batch is asked for."""
        self._end_suspended()
        gen = self._call(items, stats if stats is not None else RunStats())
        self._active, self._active_thread = gen, threading.get_ident()
        return gen

    def _end_suspended(self) -> None:
        """A stream that this thread left suspended ends here, as one dropped after `break`
        does: a new call from the thread that holds it would wait for it for ever."""
        gen = self._active
        if gen is not None and self._active_thread == threading.get_ident():
            with contextlib.suppress(ValueError):  # running: in this thread, it cannot be
                gen.close()

    def _call(self, items: Iterable[Any], stats: RunStats) -> Iterator[Batch]:
        with self._lock:
            if self._closed:
                raise SessionClosed("the session is closed")
            yield from self._stream(values_items(self.pipeline, items), stats)

    def _stream(self, items: Iterable[tuple[str, Any]], stats: RunStats) -> Iterator[Batch]:
        ex, front = self.executor, self.front
        ex.begin_call()
        stats.setup_s = self.setup_s
        stats.placement = dict(self.plan.placement)
        if self.plan.predicted is not None:
            stats.predicted = dataclasses.asdict(self.plan.predicted)
        cpu0, t0 = time.process_time(), time.perf_counter()
        reasons: Counter[str] = Counter()

        def until_closed() -> Iterator[tuple[str, Any]]:
            for item in items:
                if self._cancel.is_set():
                    return
                yield item

        for batch in ex.stream(until_closed()):
            stats.items += len(batch)
            stats.batches += 1
            stats.errors += len(batch.failures)
            reasons.update(f.reason for f in batch.failures)
            for f in batch.failures:
                stats.error_examples.setdefault(f.reason, f"{f.name}: {f.detail}")
            stats.latencies_s.extend(batch.latencies_s.tolist())
            stats.wall_s = time.perf_counter() - t0
            yield batch
        stats.wall_s = time.perf_counter() - t0
        stats.host_cpu_s = time.process_time() - cpu0
        stats.errors_by_reason = dict(reasons)
        if isinstance(ex, Chain):
            ex.report(stats)
        else:
            finish_stats(stats, ex, front)
        if self._cancel.is_set():
            raise SessionClosed(
                f"the session was closed during the call, after {stats.items} items"
            )

    def run(self, items: Iterable[Any]) -> RunResult:
        """Run `items` and return every output as numpy arrays in item order.

        `items`: bare values (bytes, str, Path) for a one-input pipeline, mappings of input name
        to value, or `(name, mapping)` pairs. Per-item failures are reported in `failures`."""
        stats = RunStats()
        n = len(items) if isinstance(items, Sized) else None  # a hint: see `collect`
        return collect(self.pipeline, self.stream(items, stats), stats, n, self._staging)

    def dataset(self, items: Iterable[Any]) -> Any:
        """A PyTorch IterableDataset of this session's batches over `items` (a list, to iterate
        it more than once): see `nicoffload.torchdata`. Needs torch."""
        from nicoffload.torchdata import dataset

        return dataset(self, items)

    def submit(self, items: Iterable[Any]) -> concurrent.futures.Future[RunResult]:
        """`run(items)` on the session's own thread; calls queue in submission order."""
        if self._closed:
            raise SessionClosed("the session is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "nicoffload-session")
        return self._pool.submit(self.run, items)


def open(
    pipeline: Pipeline | str | Path,
    plan: Plan | str | Path | None = None,
    topology: Any = None,
    *,
    token_file: str | Path | None = None,
    workers: int | None = None,
) -> Session:
    """Plan (unless given a plan), start or attach the agents, load the stages once, and return
    the open Session (a context manager). Arguments as for `nicoffload.run`."""
    return Session(prepare(pipeline, plan, topology, token_file), workers=workers)


def run(
    pipeline: Pipeline | str | Path,
    inputs: Iterable[Any],
    *,
    plan: Plan | str | Path | None = None,
    topology: Any = None,
    token_file: str | Path | None = None,
    workers: int | None = None,
) -> RunResult:
    """Run a pipeline over `inputs` on a session of its own and return every output as numpy
    arrays in item order (see `Session.run`)."""
    with open(pipeline, plan, topology, token_file=token_file, workers=workers) as session:
        return session.run(inputs)


def stream(
    prep: Prepared,
    items: Iterable[tuple[str, Any]],
    stats: RunStats,
    *,
    workers: int | None = None,
) -> Iterator[Batch]:
    """One call on a session of its own: yield batches; `stats` is complete at the end."""
    with Session(prep, workers=workers) as session:
        yield from session.stream(items, stats)


PREALLOCATE_MAX_BYTES = 8 << 30  # past this, outputs are gathered batch by batch
POOL_MAX_BYTES = 2 << 30  # the most page-locked memory a session keeps for one output


class Staging:
    """Page-locked host memory that a GPU stage's outputs come down through, batch by batch,
    into a RunResult's (pageable) arrays: one DMA at full speed and one host copy. Kept by the
    session and grown to the largest batch, so it is pinned once, not per call. Before, every
    call pinned its whole output at the end (torch rounds that up to a power of two, and the
    caller's previous result still held the last block): all-GPU `run` measured 3,230 items/s
    and 0.35 ms/item of host CPU on the H200 where `stream` gave 14,917 and 0.10
    (`bench/bench_session_run.py` times both ways side by side)."""

    def __init__(self) -> None:
        self._buf: Any = None
        # per output: page-locked memory for a whole call's rows, with the numpy array over it
        # that every RunResult's array of that output is a view of (`pooled`)
        self._pool: dict[str, tuple[Any, np.ndarray]] = {}

    def pooled(
        self, key: str, shape: tuple[int, ...], dtype: np.dtype
    ) -> tuple[np.ndarray, Any] | None:
        """Page-locked rows for a whole call's output `key` (the array, and a torch tensor over
        the same memory for the GPU to copy into: one DMA, no host copy), or None while an
        earlier call's result, or any view of it, still holds them (the caller then gets fresh
        memory through `down`), or past POOL_MAX_BYTES. Reused from call to call, so a loop
        that drops each result before the next call pins once and touches no new page."""
        import torch

        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if nbytes > POOL_MAX_BYTES or not torch.cuda.is_available():
            return None
        if key in self._pool:
            # held by the pool (1) and this call's argument (1): nothing else views it
            if sys.getrefcount(self._pool[key][1]) > 2:
                return None
            if self._pool[key][0].numel() < nbytes:
                del self._pool[key]
        if key not in self._pool:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._pool[key] = (t, t.numpy())
        t, owner = self._pool[key]
        tdtype = torch.from_numpy(np.empty(0, dtype)).dtype
        return owner[:nbytes].view(dtype).reshape(shape), t[:nbytes].view(tdtype).view(shape)

    def down(self, v: Any, out: np.ndarray) -> None:
        """Copy the torch tensor `v` (a CUDA one, through the staging memory) into `out` (same
        shape and dtype)."""
        import torch

        if out.shape != tuple(v.shape):
            raise ValueError(f"a GPU output of shape {tuple(v.shape)} for rows of {out.shape}")
        if not v.is_cuda:  # a host tensor: nothing to stage
            np.copyto(out, v.numpy())
            return
        nbytes = v.numel() * v.element_size()
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self._buf[:nbytes].view(v.dtype).view(v.shape)
        staged.copy_(v)  # synchronous: the bytes are on the host when it returns
        np.copyto(out, staged.numpy())


def collect(
    pipeline: Pipeline,
    batches: Iterable[Batch],
    stats: RunStats,
    n: int | None = None,
    staging: Staging | None = None,
) -> RunResult:
    """A call's batches gathered into one RunResult (rows copied out of the reused slots).
    With `n`, the number of items when it is known, each static output is allocated once and
    every batch copied straight into its rows (one copy, each page touched once); else each
    batch is copied out and the copies concatenated at the end. A GPU stage's outputs stay on
    the GPU too (`RunResult.torch()`) and come down batch by batch through `staging`."""
    staging = staging if staging is not None else Staging()
    names: list[str] = []
    specs = pipeline.output_specs()
    parts: dict[str, list[Any]] = {k: [] for k in pipeline.outputs}
    whole: dict[str, np.ndarray] = {}
    row_bytes = sum(specs[k].typical_nbytes for k in pipeline.outputs if specs[k].static)
    if n is not None and n * row_bytes > PREALLOCATE_MAX_BYTES:
        n = None  # a len() that lies high (or a very large call) must not allocate up front
    if n is not None:
        whole = {
            k: np.empty((n, *specs[k].shape), specs[k].dtype)
            for k in pipeline.outputs
            if specs[k].static
        }
    on_gpu: dict[str, list[Any]] = {}
    pinned: dict[str, Any] = {}  # output -> the torch view of its pooled page-locked rows
    oks, failures = [], []
    at = 0
    for batch in batches:
        names.extend(batch.names)
        oks.append(batch.ok.copy())
        failures.extend(batch.failures)
        host = {}
        for k, v in batch.outputs.items():
            if hasattr(v, "is_cuda"):  # a GPU stage's tensor (fresh per batch): kept for torch()
                on_gpu.setdefault(k, []).append(v)
                fits = k in whole and whole[k].dtype == _numpy_dtype(v)  # never a silent cast
                first = fits and at == 0 and v.is_cuda and k not in pinned
                if first and (got := staging.pooled(k, whole[k].shape, whole[k].dtype)):
                    whole[k], pinned[k] = got
                if k in pinned and at + len(v) <= len(whole[k]):
                    pinned[k][at : at + len(v)].copy_(v)  # synchronous: on the host on return
                    parts[k].append(None)  # already in place
                    continue
                if fits and at + len(v) <= len(whole[k]):
                    staging.down(v, whole[k][at : at + len(v)])
                    parts[k].append(None)  # already in place
                    continue
                down = np.empty(tuple(v.shape), _numpy_dtype(v))
                staging.down(v, down)
                parts[k].append(down)
                continue
            else:
                host[k] = v
        for k, v in replace(batch, outputs=host).numpy().outputs.items():
            if k in whole and at + len(v) <= len(whole[k]):
                whole[k][at : at + len(v)] = v
                parts[k].append(None)  # already in place
            else:
                parts[k].append(v.copy() if isinstance(v, np.ndarray) else list(v))
        at += len(batch.names)
    outputs: dict[str, Any] = {}
    for k, chunks in parts.items():
        if k in whole and all(c is None for c in chunks):
            outputs[k] = whole[k][:at]
        elif specs[k].static:
            if k in whole:  # more items than announced: what went in place, then the rest
                done = sum(1 for c in chunks if c is None)
                chunks = [whole[k][: sum(len(b) for b in oks[:done])], *chunks[done:]]
            outputs[k] = (
                np.concatenate(chunks) if chunks else np.zeros((0, *specs[k].shape), specs[k].dtype)
            )
        elif k in on_gpu:  # a GPU stage's tensors: one array, as they came
            outputs[k] = np.concatenate(chunks)
        else:
            outputs[k] = [x for c in chunks for x in c]
    ok = np.concatenate(oks) if oks else np.zeros(0, bool)
    gpu_out: dict[str, Any] = {}
    if on_gpu:
        import torch

        gpu_out = {k: torch.cat(v) for k, v in on_gpu.items()}
    return RunResult(names, outputs, ok, failures, stats, gpu_out)


def _numpy_dtype(v: Any) -> np.dtype:
    """The numpy dtype of a torch tensor."""
    import torch

    return torch.empty(0, dtype=v.dtype).numpy().dtype
