"""The GPU device: whether CUDA works here (and why not), its allocator, streams, pinned staging.

torch owns the CUDA context, the caching allocator, streams, events and pinned host memory; CuPy
compiles our raw kernels (NVRTC) and launches them on torch's streams, on torch's memory. Both
are imported on first use, never at `import nicoffload`; `availability()` never raises.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nicoffload.errors import DeviceError, MissingDependency

PINNED_ALIGN = 256  # bytes; every staged item starts on this boundary (DMA and vector loads)


@dataclass(frozen=True)
class Availability:
    """Whether the GPU can be used here; `reason` says what was found, or why it cannot."""

    ok: bool
    reason: str


@functools.cache
def availability(index: int = 0) -> Availability:
    """Probe torch, CUDA and CuPy once per process; the answer carries a reason either way."""
    try:
        import torch
    except ImportError:
        return Availability(False, "torch is not installed (pip install 'nicoffload[gpu]')")
    try:
        if not torch.cuda.is_available():
            return Availability(
                False,
                f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})",
            )
        count = torch.cuda.device_count()
        if index >= count:
            return Availability(False, f"no CUDA device {index}: this machine has {count}")
        name = torch.cuda.get_device_name(index)
    except Exception as exc:  # a broken driver raises anything
        return Availability(False, f"CUDA failed to initialize: {exc}")
    try:
        import cupy
    except ImportError:
        return Availability(False, "cupy is not installed (pip install 'nicoffload[gpu]')")
    return Availability(
        True,
        f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {cupy.__version__}",
    )


class GpuDevice:
    """One CUDA device: allocation (torch's caching allocator), streams, raw-kernel launches."""

    def __init__(self, index: int = 0) -> None:
        found = availability(index)
        if not found.ok:
            raise DeviceError(f"gpu{index}: {found.reason}")
        import cupy
        import torch

        self.torch = torch
        self.cupy = cupy
        self.index = index
        self.device = torch.device("cuda", index)
        self.name = torch.cuda.get_device_name(index)
        self._ext: dict[int, Any] = {}
        self._modules: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> GpuDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the device's work; cached allocations stay with torch's allocator."""
        self.torch.cuda.synchronize(self.device)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """Device memory from torch's caching allocator, owned by the current stream."""
        return self.torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def upload(self, array: Any) -> Any:
        """A host array (numpy or torch) on the device, copied on the current stream."""
        t = array if isinstance(array, self.torch.Tensor) else self.torch.from_numpy(array)
        return t.to(self.device, non_blocking=t.is_pinned())

    def cupy_stream(self, stream: Any = None) -> Any:
        """The CuPy view of a torch stream (the current one by default), for raw launches."""
        ptr = (stream or self.current_stream()).cuda_stream
        ext = self._ext.get(ptr)
        if ext is None:
            ext = self._ext[ptr] = self.cupy.cuda.ExternalStream(ptr, self.index)
        return ext

    def as_cupy(self, tensor: Any) -> Any:
        """A CuPy array sharing the tensor's memory (DLPack, no copy)."""
        return self.cupy.from_dlpack(tensor)

    def module(self, source: str, names: Sequence[str], options: Sequence[str] = ()) -> Any:
        """Compile CUDA source once per process (NVRTC) and return the CuPy RawModule."""
        key = (source, tuple(names) + tuple(options))
        with self._lock:
            mod = self._modules.get(key)
            if mod is None:
                with self.cupy.cuda.Device(self.index):
                    mod = self.cupy.RawModule(
                        code=source, options=tuple(options), name_expressions=tuple(names)
                    )
                    for n in names:  # compile now: plan time, not the first batch
                        mod.get_function(n)
                self._modules[key] = mod
        return mod


@functools.cache
def device(index: int = 0) -> GpuDevice:
    """The process's handle on CUDA device `index` (created on first use, like torch's own)."""
    return GpuDevice(index)


def torchvision_io() -> Any:
    """torchvision.io, for nvJPEG; a clear error names the extra when it is missing."""
    try:
        import torchvision.io
    except ImportError as exc:
        raise MissingDependency("torchvision", "gpu", "decoding JPEGs on the GPU") from exc
    return torchvision.io


class PinnedSlot:
    """One pinned host buffer, and the CUDA event of the last copy that read it."""

    def __init__(self, gpu: GpuDevice, index: int, nbytes: int) -> None:
        self.gpu = gpu
        self.index = index
        self.tensor = gpu.torch.empty(nbytes, dtype=gpu.torch.uint8, pin_memory=True)
        self.array = self.tensor.numpy()  # the same memory, for host writers
        self.event: Any = None
        self.busy = False  # taken, and its copy not issued yet

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


class PinnedRing:
    """`count` pinned host buffers used in turn, so batch k+1 is written while k is copied.

    A slot is busy from `take()` until `copy_in()` issues its copy (or `give_back()`), and is
    refilled only once that copy's event has fired: the host waits for one copy, never for the
    whole device, and at most `count` batches are staged at once (the backpressure). A batch
    larger than its slot grows it once (pinned allocation is slow; it leaves the steady state).
    """

    def __init__(self, gpu: GpuDevice, count: int = 3, nbytes: int = 64 << 20) -> None:
        if count < 2:
            raise ValueError("a pinned ring needs at least 2 slots to overlap copies")
        self.gpu = gpu
        self._slots = [PinnedSlot(gpu, i, nbytes) for i in range(count)]
        self._next = 0
        self._cond = threading.Condition()

    def __enter__(self) -> PinnedRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            slots, self._slots = self._slots, []
        for s in slots:
            if s.event is not None:
                s.event.synchronize()

    def take(self, nbytes: int) -> PinnedSlot:
        with self._cond:
            if not self._slots:
                raise DeviceError("the pinned staging ring is closed")
            i = self._next
            self._next = (i + 1) % len(self._slots)
            while self._slots[i].busy:
                self._cond.wait()
            slot = self._slots[i]
            slot.busy = True
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        if slot.nbytes < nbytes:
            grown = PinnedSlot(self.gpu, i, max(nbytes, 2 * slot.nbytes))
            grown.busy = True
            with self._cond:
                self._slots[i] = grown
            slot = grown
        return slot

    def give_back(self, slot: PinnedSlot) -> None:
        """Return a slot whose contents will not be copied after all."""
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def copy_in(self, slot: PinnedSlot, nbytes: int, stream: Any) -> Any:
        """Copy the slot's first `nbytes` to new device memory on `stream`; returns the tensor.

        The destination is allocated on `stream` (so the allocator orders its reuse after the
        copy) and the slot's event marks the copy: the slot is refilled only after it was read.
        """
        torch = self.gpu.torch
        with torch.cuda.stream(stream):
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.gpu.device)
            dst.copy_(slot.tensor[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        slot.event = event
        self.give_back(slot)
        return dst


def packed_offsets(sizes: Sequence[int], align: int = PINNED_ALIGN) -> tuple[list[int], int]:
    """Offsets of items laid back to back, each aligned; and the total size."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-int(n) // align) * align
    return offsets, pos
