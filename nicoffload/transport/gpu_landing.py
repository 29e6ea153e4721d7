"""A receiver's batches landed in GPU memory: the GPU destination of a transport.

Where the receiver's ring is host memory (shm, tcp, an rdma ring without GPUDirect), the ring is
page-locked for CUDA once (`cudaHostRegister` over the whole buffer the deliveries point into)
and each delivery's tensors are copied to device memory asynchronously on the landing's stream.
The slot goes back to the sender only once that copy has completed (a CUDA event): the sender
never overwrites a slot the GPU is still reading. `recv` returns as soon as a batch's copy is
issued (the caller queues its GPU work behind it), and the next `recv` first waits for that copy
and gives its slot back, so the sender, writing the next batch into another slot meanwhile, is
never left waiting on a slot only the caller could free. An rdma ring in GPU memory itself
(`rdma://...?gpu=N` under nvidia-peermem: the NIC writes the GPU directly) is landed the same way
with a device-to-device copy, which frees its slot for the next write at once.

    with GpuLanding(receiver) as landing:
        while (d := landing.recv()) is not None:
            d.on(torch.cuda.current_stream())   # order the consumer after the copy
            model(d.tensors["x"])               # torch CUDA tensors (DLPack for CuPy)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import DeviceError, TransportError
from nicoffload.transport.base import Delivery, Receiver


@dataclass
class GpuDelivery:
    """One batch in device memory; `ready` fires when its copy has completed."""

    slot: int
    request_id: int
    batch_size: int
    tensors: dict[str, Any]  # torch CUDA tensors, owned by the caller (the slot is not theirs)
    meta: dict[str, Any]
    ready: Any  # torch.cuda.Event
    nbytes: int = 0
    started: Any = None  # an event before the copies, when the landing times them

    def copy_ms(self) -> float:
        """Device time of this batch's copies (needs `GpuLanding(timing=True)`; waits for them)."""
        if self.started is None:
            raise ValueError("copies are timed only by GpuLanding(..., timing=True)")
        self.ready.synchronize()
        return float(self.started.elapsed_time(self.ready))

    def on(self, stream: Any) -> GpuDelivery:
        """Make `stream` wait for the copy, and tell the allocator the tensors are used there."""
        stream.wait_event(self.ready)
        for t in self.tensors.values():
            t.record_stream(stream)
        return self

    def wait(self) -> GpuDelivery:
        """Block the calling thread until the copy has completed."""
        self.ready.synchronize()
        return self


@dataclass
class _Pending:
    delivery: Delivery
    event: Any


def _root(a: np.ndarray) -> np.ndarray:
    """The outermost numpy array a view was cut from (the receiver's ring buffer)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class GpuLanding:
    """Copies each delivery of `receiver` to the GPU (see the module's docstring)."""

    def __init__(
        self, receiver: Receiver, gpu: Any = None, *, stream: Any = None, timing: bool = False
    ) -> None:
        if gpu is None:
            from nicoffload.devices.gpu import device

            gpu = device()
        self.receiver, self.gpu = receiver, gpu
        self.torch, self.cupy = gpu.torch, gpu.cupy
        self.stream = stream or gpu.new_stream()
        self.timing = timing
        self._registered: dict[int, int] = {}  # host address -> bytes
        self._pending: collections.deque[_Pending] = collections.deque()
        self._closed = False
        self.copies = 0  # batches landed
        self.bytes = 0

    def __enter__(self) -> GpuLanding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def recv(self, timeout: float | None = None) -> GpuDelivery | None:
        """The next batch in device memory (its copy issued, maybe not finished: see `on`);
        None once the sender has closed. TransportError as the receiver raises it."""
        if self._closed:
            raise TransportError("the GPU landing is closed")
        # Every slot back before waiting: the sender may be waiting for one (a flush, say).
        self._retire()
        d = self.receiver.recv(timeout)
        if d is None:
            return None
        try:
            landed = self._land(d)
        except BaseException:
            self.receiver.release(d)
            raise
        return landed

    def _land(self, d: Delivery) -> GpuDelivery:
        torch, rt = self.torch, self.cupy.cuda.runtime
        out: dict[str, Any] = {}
        copies = []
        with torch.cuda.stream(self.stream):  # allocations ordered on the landing's stream
            for name, src in d.tensors.items():
                if src.nbytes and not src.flags.c_contiguous:
                    raise TransportError(f"tensor {name!r} of slot {d.slot} is not contiguous")
                on_gpu = not isinstance(src, np.ndarray)  # a ring in GPU memory (GPUDirect)
                if not on_gpu:
                    self._register(src)
                dtype = _torch_dtype(torch, np.dtype(src.dtype))
                out[name] = torch.empty(src.shape, dtype=dtype, device=self.gpu.device)
                if src.nbytes:
                    addr = int(src.data.ptr) if on_gpu else src.ctypes.data
                    kind = rt.memcpyDeviceToDevice if on_gpu else rt.memcpyHostToDevice
                    copies.append((out[name].data_ptr(), addr, src.nbytes, kind))
            started = None
            if self.timing:  # just before the copies: what is timed is the copies alone
                started = torch.cuda.Event(enable_timing=True)
                started.record(self.stream)
            for dst, src, n, kind in copies:
                rt.memcpyAsync(dst, src, n, kind, self.stream.cuda_stream)
            event = torch.cuda.Event(enable_timing=self.timing)
            event.record(self.stream)
        nbytes = sum(c[2] for c in copies)
        landed = GpuDelivery(
            d.slot, d.request_id, d.batch_size, out, dict(d.meta), event, nbytes, started
        )
        self._pending.append(_Pending(d, event))
        self.copies += 1
        self.bytes += nbytes
        return landed

    def _register(self, view: np.ndarray) -> None:
        """Page-lock the buffer `view` lies in, once (the ring: every later slot is in it too)."""
        root = _root(view)
        addr, size = root.ctypes.data, root.nbytes
        if not size or addr in self._registered:
            return
        lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
        if not (addr <= lo and hi <= addr + size):
            raise TransportError("a delivery's tensor lies outside its receiver's ring buffer")
        try:
            self.cupy.cuda.runtime.hostRegister(addr, size, 0)
        except self.cupy.cuda.runtime.CUDARuntimeError as exc:
            raise DeviceError(
                f"{self.gpu.device}: cannot page-lock the receiver's ring ({size} bytes): {exc}"
            ) from exc
        self._registered[addr] = size

    def _retire(self) -> None:
        """Wait for the copies issued so far and give their slots back."""
        while self._pending:
            p = self._pending.popleft()
            p.event.synchronize()
            self.receiver.release(p.delivery)

    def close(self) -> None:
        """Wait for the copies in flight, give their slots back, unpin the rings. Idempotent;
        the receiver itself is the caller's to close (after this)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._retire()
        except TransportError:  # the sender is gone: its slots need no credit
            self._pending.clear()
        finally:
            for addr in self._registered:
                self.cupy.cuda.runtime.hostUnregister(addr)
            self._registered.clear()


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    try:
        return {
            "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
            "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16,
            "uint32": torch.uint32, "uint64": torch.uint64, "float16": torch.float16,
            "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
        }[np.dtype(dtype).name]  # fmt: skip
    except KeyError:
        raise TransportError(f"no torch dtype for {np.dtype(dtype).name}") from None
