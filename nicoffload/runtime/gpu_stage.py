"""GpuStage: the nodes of a StagePlan placed on the GPU, run a whole batch at a time.

A batch arrives as encoded bytes (decode on the GPU) or host images. Host images are staged
through a ring of pinned buffers and copied on a copy stream; the kernels run on a compute
stream; outputs stay on the device as torch tensors (CuPy arrays through DLPack, no copy).
`stream()` overlaps batches: a decoding stage runs headers, nvJPEG calls and kernels on three
threads (nvJPEG, one decoder per process, is never left idle), another stage runs two workers
on alternate batches; either way the copies of batch k+1 overlap the kernels of batch k.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nicoffload.errors import ItemError
from nicoffload.graph import Pipeline
from nicoffload.planner.plan import StagePlan
from nicoffload.runtime.buffers import drain as drain_until
from nicoffload.runtime.buffers import put_unless
from nicoffload.runtime.stage import bind_steps


@dataclass
class HostBatch:
    """A batch of host arrays living in one pinned slot; producers write rows in place."""

    slot: Any
    arrays: list[np.ndarray]
    offsets: list[int]
    nbytes: int

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def uniform(self) -> bool:
        return all(a.shape == self.arrays[0].shape for a in self.arrays)


@dataclass
class GpuBatch:
    """One batch's device outputs; valid once `done` has fired (`wait()`, or make a stream wait)."""

    index: int
    n: int
    outputs: dict[str, Any]
    failures: dict[int, ItemError]
    done: Any
    # rows the stage's first step produced a value for (failed rows aside): a row it did not
    # produce was never computed for its item and must not come out as ok
    produced: np.ndarray | None = None
    _timing: list[tuple[int, Any, Any]] = field(default_factory=list, repr=False)
    _host_ms: list[tuple[int, float]] = field(default_factory=list, repr=False)
    # Every intermediate (decoded images, staged copies), held until the batch is done: memory
    # allocated on a worker's copy or decode stream and read on its compute stream is only
    # freed once that reading finished (instead of record_stream on each tensor).
    _keep: dict[str, Any] | None = field(default=None, repr=False)

    def wait(self) -> GpuBatch:
        self.done.synchronize()
        self._keep = None
        return self

    def __del__(self) -> None:
        if self._keep is not None:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
                self.done.synchronize()

    def ready(self) -> bool:
        return bool(self.done.query())

    @property
    def ok(self) -> np.ndarray:
        ok = np.ones(self.n, dtype=bool)
        ok[list(self.failures)] = False
        return ok

    def as_cupy(self) -> dict[str, Any]:
        """The outputs as CuPy arrays sharing the tensors' memory (DLPack; lists stay lists)."""
        import cupy

        def conv(v: Any) -> Any:
            if isinstance(v, list):
                return [None if t is None else cupy.from_dlpack(t) for t in v]
            return cupy.from_dlpack(v)

        self.wait()
        return {k: conv(v) for k, v in self.outputs.items()}


_END = object()


@dataclass
class _Failure:
    where: str
    exc: BaseException


@dataclass
class _Job:
    """A batch on its way through the stage's phases."""

    index: int
    n: int
    values: dict[str, Any] = field(default_factory=dict)
    failed: dict[int, ItemError] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)  # device work the kernels must wait for
    decode: Any = None  # the decoder's DecodeJob when the stage starts by decoding
    host_ms: list[tuple[int, float]] = field(default_factory=list)


def _produced(value: Any, n: int) -> np.ndarray:
    """Which of a step's `n` rows hold a value: every row of an (n, ...) tensor, the non-None
    entries of a list (a list or tensor of another length: none)."""
    if isinstance(value, list):
        got = np.fromiter((v is not None for v in value), bool, len(value))
    else:
        got = np.ones(len(value), bool)
    return got if len(got) == n else np.zeros(n, bool)


class _Streams:
    def __init__(self, gpu: Any) -> None:
        self.copy = gpu.new_stream()
        self.decode = gpu.new_stream()
        self.compute = gpu.new_stream()


class GpuStage:
    """A StagePlan on the GPU. `process(batch)` runs one batch on the calling thread;
    `stream(batches)` runs many on `workers` threads and yields them in order."""

    def __init__(
        self,
        pipeline: Pipeline,
        plan: StagePlan,
        keep: set[str],
        *,
        gpu: Any = None,
        workers: int = 2,
        slots: int = 3,
        slot_bytes: int = 64 << 20,
    ) -> None:
        from nicoffload.devices.gpu import PinnedRing, device

        self.plan = plan
        self.gpu = gpu or device()
        nodes = [pipeline.node(n) for n in plan.nodes]
        self.steps = bind_steps(pipeline, nodes, "gpu", keep)
        produced = [w for s in self.steps for w in s.writes]
        self.inputs = list(
            dict.fromkeys(k for s in self.steps for k in s.reads if k not in produced)
        )
        last = set(self.steps[-1].writes)
        self.outputs = [k for k in produced if k in keep or k in last]
        self.workers = workers
        self.ring = PinnedRing(self.gpu, max(slots, workers + 1), slot_bytes)
        self._local = threading.local()
        self._lock = threading.Lock()
        # Streams of the worker threads of finished `stream()` calls, for the next call's: the
        # caching allocator keeps freed memory per stream, so new streams every call would
        # strand gigabytes (1080p batches) until an allocation fails and it frees everything.
        self._spare: list[_Streams] = []
        self.step_ms = np.zeros(len(self.steps))
        self.items = 0
        self._mark: tuple[np.ndarray, int] = (np.zeros(len(self.steps)), 0)  # at begin_call

    def __enter__(self) -> GpuStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.ring.close()
        self.gpu.torch.cuda.synchronize(self.gpu.device)

    def _streams(self) -> _Streams:
        s = getattr(self._local, "streams", None)
        if s is None:
            s = self._local.streams = _Streams(self.gpu)
        return s

    def _take_streams(self, lent: list[_Streams]) -> None:
        """On a worker thread, first thing: its streams for life, a finished call's if any."""
        with self._lock:
            s = self._spare.pop() if self._spare else _Streams(self.gpu)
            lent.append(s)
        self._local.streams = s

    def _give_back(self, lent: list[_Streams]) -> None:
        """After the call's workers have ended: their streams serve the next call."""
        with self._lock:
            self._spare.extend(lent)
        lent.clear()

    def host_batch(self, shapes: Sequence[tuple[int, ...]], dtype: Any = np.uint8) -> HostBatch:
        """Pinned room for a batch of host arrays; fill `arrays[i]`, then pass it to `process`."""
        from nicoffload.devices.gpu import packed_offsets

        itemsize = np.dtype(dtype).itemsize
        sizes = [int(np.prod(s)) * itemsize for s in shapes]
        offsets, total = packed_offsets(sizes)
        slot = self.ring.take(total)
        arrays = [
            slot.array[o : o + n].view(dtype).reshape(s)
            for o, n, s in zip(offsets, sizes, shapes, strict=True)
        ]
        return HostBatch(slot, arrays, offsets, total)

    def _stage_in(self, value: Any, streams: _Streams, events: list[Any]) -> Any:
        """Host arrays go through a pinned slot and one copy (its event joins `events`);
        bytes and CUDA tensors pass as they are."""
        torch = self.gpu.torch
        if isinstance(value, Sequence) and value and isinstance(value[0], np.ndarray):
            hb = self.host_batch([a.shape for a in value], value[0].dtype)
            for dst, src in zip(hb.arrays, value, strict=True):
                np.copyto(dst, src)
            value = hb
        if not isinstance(value, HostBatch):
            return value
        flat = self.ring.copy_in(value.slot, value.nbytes, streams.copy)
        events.append(value.slot.event)
        dtype = torch.from_numpy(value.arrays[0][:0]).dtype
        base = flat.view(dtype)
        size = value.arrays[0].itemsize
        if value.uniform:  # one strided (N, ...) tensor over the slot's aligned rows
            a = value.arrays[0]
            step = (value.offsets[1] if len(value.offsets) > 1 else a.nbytes) // size
            strides = (step, *(s // size for s in a.strides))
            return base.as_strided((len(value.arrays), *a.shape), strides)
        return [
            base[o // size : o // size + a.size].view(a.shape)
            for o, a in zip(value.offsets, value.arrays, strict=True)
        ]

    def process(self, batch: Mapping[str, Any], index: int = 0) -> GpuBatch:
        """Launch one batch (`{input key: items}`) from the calling thread; returns before the
        device has finished (decoding, which is synchronous, excepted)."""
        job = self._begin(batch, index)
        self._decode(job)
        return self._finish(job)

    def _begin(self, batch: Mapping[str, Any], index: int) -> _Job:
        """Host work first: stage host arrays, read JPEG headers."""
        st = self._streams()
        job = _Job(index, len(batch[self.inputs[0]]))
        job.values = {k: self._stage_in(batch[k], st, job.events) for k in self.inputs}
        first = self.steps[0]
        if first.nodes[0].op == "decode_image":
            job.decode = first.fn.prepare(job.values[first.reads[0]], job.failed)
        return job

    def _decode(self, job: _Job) -> None:
        """The nvJPEG call alone, on this thread's decode stream; its end is an event."""
        if job.decode is None:
            return
        torch = self.gpu.torch
        st = self._streams()
        t0 = time.perf_counter()
        with torch.cuda.stream(st.decode):
            self.steps[0].fn.run(job.decode)
            event = torch.cuda.Event()
            event.record(st.decode)
        job.events.append(event)
        job.host_ms.append((0, (time.perf_counter() - t0) * 1e3))

    def _finish(self, job: _Job) -> GpuBatch:
        """Every other step on this thread's compute stream, after the copies and the decode."""
        torch = self.gpu.torch
        st = self._streams()
        values, timing = job.values, []
        with torch.cuda.stream(st.compute):
            for e in job.events:
                st.compute.wait_event(e)
            for i, step in enumerate(self.steps):
                args = [values[k] for k in step.reads]
                if i == 0 and job.decode is not None:
                    result = step.fn.finish(job.decode, job.failed)
                else:
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(st.compute)
                    result = step.fn(*args, failed=job.failed)
                    e1.record(st.compute)
                    timing.append((i, e0, e1))
                results = (result,) if len(step.writes) == 1 else result
                if i == 0:
                    produced = _produced(results[0], job.n)
                values.update(zip(step.writes, results, strict=True))
            # a blocking event: whoever waits for the batch sleeps instead of spinning a core
            done = torch.cuda.Event(blocking=True)
            done.record(st.compute)
        outputs = {k: values[k] for k in self.outputs}
        return GpuBatch(
            job.index, job.n, outputs, job.failed, done, produced, timing, job.host_ms, values
        )

    def _account(self, b: GpuBatch) -> None:
        b.wait()
        with self._lock:
            for i, e0, e1 in b._timing:
                self.step_ms[i] += e0.elapsed_time(e1)
            for i, ms in b._host_ms:
                self.step_ms[i] += ms
            self.items += b.n
        b._timing, b._host_ms = [], []

    def stream(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[GpuBatch]:
        """Run batches and yield each, finished, in order.

        A stage that decodes runs three threads, so nvJPEG (one decoder per process) is never
        idle: headers and staging, the nvJPEG calls alone, the kernels; others run `workers`
        threads on alternate batches. Either way the copies and kernels of batch k+1 overlap
        the device work of batch k.
        """
        if self.steps[0].nodes[0].op == "decode_image":
            yield from self._pipeline(batches)
            return
        lent: list[_Streams] = []
        pool = ThreadPoolExecutor(
            self.workers,
            thread_name_prefix="nicoffload-gpu",
            initializer=self._take_streams,
            initargs=(lent,),
        )
        pending: deque[Any] = deque()
        try:
            for i, b in enumerate(batches):
                pending.append(pool.submit(self.process, b, i))
                if len(pending) > self.workers:
                    done = pending.popleft().result()
                    self._account(done)
                    yield done
            while pending:
                done = pending.popleft().result()
                self._account(done)
                yield done
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self._give_back(lent)

    def _pipeline(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[GpuBatch]:
        stop = threading.Event()
        to_decode: queue.Queue[Any] = queue.Queue(maxsize=2)
        to_finish: queue.Queue[Any] = queue.Queue(maxsize=2)
        done: queue.Queue[Any] = queue.Queue(maxsize=2)

        def put(q: queue.Queue[Any], item: Any) -> bool:
            return put_unless(q, item, stop)

        lent: list[_Streams] = []

        def run(name: str, source: Any, work: Any, sink: queue.Queue[Any]) -> None:
            try:
                self._take_streams(lent)
                for item in source():
                    if not put(sink, work(item)):
                        return
                put(sink, _END)
            except BaseException as exc:  # carried to the consumer, re-raised there
                put(done, _Failure(name, exc))
                stop.set()

        def drain(q: queue.Queue[Any]) -> Iterator[Any]:
            return drain_until(q, stop, _END)

        def produce() -> Iterator[Any]:
            for i, b in enumerate(batches):
                if stop.is_set():
                    return
                yield (i, b)

        def decode(job: _Job) -> _Job:
            self._decode(job)
            return job

        threads = [
            threading.Thread(
                target=run, args=("prepare", produce, lambda p: self._begin(p[1], p[0]), to_decode)
            ),
            threading.Thread(
                target=run, args=("decode", lambda: drain(to_decode), decode, to_finish)
            ),
            threading.Thread(
                target=run, args=("kernels", lambda: drain(to_finish), self._finish, done)
            ),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        try:
            while True:
                item = done.get()
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                self._account(item)
                yield item
        finally:
            stop.set()
            for t in threads:
                t.join()
            self._give_back(lent)

    def begin_call(self) -> None:
        """A session's new call: `step_ms_per_item` counts from here."""
        with self._lock:
            self._mark = (self.step_ms.copy(), self.items)

    def step_ms_per_item(self) -> dict[str, float]:
        """Measured time per item of each step in the current call (since `begin_call`): device
        time (events), decode by host clock."""
        with self._lock:
            ms0, n0 = self._mark
            n = max(self.items - n0, 1)
            spent = self.step_ms - ms0
            return {s.name: float(ms) / n for s, ms in zip(self.steps, spent, strict=True)}
