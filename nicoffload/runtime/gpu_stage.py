"""GpuStage: the nodes of a StagePlan placed on the GPU, run a whole batch at a time.

A batch arrives as encoded bytes (decode on the GPU) or host images. Host images are staged
through a ring of pinned buffers and copied on a copy stream; the kernels run on a compute
stream; outputs stay on the device as torch tensors (CuPy arrays through DLPack, no copy).
Two workers take alternate batches, so the host side of batch k+1 (staging, header parsing,
nvJPEG's host phase, descriptor building) and its copies overlap the device work of batch k.
"""

from __future__ import annotations

import contextlib
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
        self.step_ms = np.zeros(len(self.steps))
        self.items = 0

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

    def _stage_in(self, value: Any, streams: _Streams) -> Any:
        """Host arrays go through a pinned slot and one copy; bytes and CUDA tensors pass."""
        torch = self.gpu.torch
        if isinstance(value, Sequence) and value and isinstance(value[0], np.ndarray):
            hb = self.host_batch([a.shape for a in value], value[0].dtype)
            for dst, src in zip(hb.arrays, value, strict=True):
                np.copyto(dst, src)
            value = hb
        if not isinstance(value, HostBatch):
            return value
        flat = self.ring.copy_in(value.slot, value.nbytes, streams.copy)
        streams.compute.wait_event(value.slot.event)
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
        """Launch one batch (`{input key: items}`); returns before the device has finished."""
        torch = self.gpu.torch
        st = self._streams()
        first = batch[self.inputs[0]]
        n = len(first)
        failed: dict[int, ItemError] = {}
        values = {k: self._stage_in(batch[k], st) for k in self.inputs}
        timing, host_ms = [], []
        with torch.cuda.stream(st.compute):
            for i, step in enumerate(self.steps):
                args = [values[k] for k in step.reads]
                if step.nodes[0].op == "decode_image":  # synchronous, on its own stream
                    t0 = time.perf_counter()
                    with torch.cuda.stream(st.decode):
                        result = step.fn(*args, failed=failed)
                    st.compute.wait_stream(st.decode)
                    host_ms.append((i, (time.perf_counter() - t0) * 1e3))
                else:
                    e0, e1 = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    e0.record(st.compute)
                    result = step.fn(*args, failed=failed)
                    e1.record(st.compute)
                    timing.append((i, e0, e1))
                results = (result,) if len(step.writes) == 1 else result
                values.update(zip(step.writes, results, strict=True))
            done = torch.cuda.Event()
            done.record(st.compute)
        outputs = {k: values[k] for k in self.outputs}
        return GpuBatch(index, n, outputs, failed, done, timing, host_ms, values)

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
        """Run batches on the workers; yield each, finished, in order."""
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="nicoffload-gpu")
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

    def step_ms_per_item(self) -> dict[str, float]:
        """Measured time per item of each step: device time (events), decode by host clock."""
        with self._lock:
            n = max(self.items, 1)
            return {s.name: float(ms) / n for s, ms in zip(self.steps, self.step_ms, strict=True)}
