"""How a batch lies in a slot: a Packer lays tensors out and writes the DATA frame head (sender),
an Unpacker turns a DATA frame into zero-copy views (receiver), a Ledger tracks busy slots.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor  # imported now: not at interpreter shutdown
from dataclasses import dataclass
from typing import Any

import numpy as np

from nicoffload.errors import FrameError, TransportError
from nicoffload.procstat import cores
from nicoffload.transport.frame import (
    DataMeta,
    DType,
    Header,
    Kind,
    TensorEntry,
    decode_meta,
    encode_meta,
    restamp,
)

ALIGN = 64  # each tensor starts on a cache line of its slot (and a DMA-friendly boundary)
CACHED_LAYOUTS = 64  # recurring batch shapes remembered per sender / receiver
_PAD = np.zeros(ALIGN, np.uint8)
_TENSOR_DTYPES = frozenset(d.value for d in DType if d is not DType.NONE)

Tensors = Mapping[str, np.ndarray] | Sequence[np.ndarray]


def stride(slot_bytes: int) -> int:
    """Distance between slots in a ring: slot_bytes rounded up so every slot starts ALIGN-ed."""
    return -(-slot_bytes // ALIGN) * ALIGN


def slot_view(ring: np.ndarray, slot: int, slot_bytes: int) -> np.ndarray:
    """The uint8 array over one slot of `ring`."""
    start = slot * stride(slot_bytes)
    return ring[start : start + slot_bytes]


@dataclass(frozen=True, eq=False)
class Delivery:
    """One batch in a receiver's slot. `tensors` are views into the slot: valid until release."""

    slot: int
    request_id: int
    batch_size: int
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any]


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a batch's tensors lie in a slot, and its DATA frame head (with slot 0, request 0)."""

    offsets: tuple[int, ...]
    nbytes: int
    head: bytes

    def announce(self, slot: int, request_id: int) -> bytes | bytearray:
        return restamp(self.head, slot, request_id)

    def payload(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The payload as it lies in the slot: each array as contiguous bytes (copied only if it
        was not contiguous), with the ALIGN padding between them; for a gathered send."""
        out, at = [], 0
        for a, start in zip(arrays, self.offsets, strict=True):
            if start > at:
                out.append(_PAD[: start - at])
            if a.nbytes:
                out.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            at = start + a.nbytes
        return out

    def copy_into(self, slot: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        """memcpy every array to its place in `slot` (a uint8 array over the receiver's slot);
        a big batch on several threads (`copy_flat`)."""
        pairs = []
        for a, start in zip(arrays, self.offsets, strict=True):
            if not a.nbytes:
                continue
            dst = slot[start : start + a.nbytes]
            if a.flags.c_contiguous:
                pairs.append((dst, a.reshape(-1).view(np.uint8)))
            else:
                np.copyto(dst.view(a.dtype).reshape(a.shape), a)
        copy_flat(pairs)


# A batch this big is copied into a slot by several threads: on the H200 host's Xeon one thread
# copied a decoded batch (36 MB) into a shared-memory slot at about 2.4 GB/s, and that copy was
# 78% of the busiest thread of an agent that decodes (its forwarder): the stage's limit.
PARALLEL_COPY_BYTES = 4 << 20
COPY_THREADS = 4  # at most; never more than the cores this process may run on
_copy_pool: tuple[int, Any] | None = None  # (pid, ThreadPoolExecutor): a forked child makes its own
_copy_lock = threading.Lock()


def copy_threads() -> int:
    """The threads a big copy is cut for: COPY_THREADS, at most the cores this may run on."""
    return max(1, min(COPY_THREADS, cores()))


def _pool() -> Any:
    global _copy_pool
    with _copy_lock:
        if _copy_pool is None or _copy_pool[0] != os.getpid():
            pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="nicoffload-copy")
            _copy_pool = (os.getpid(), pool)
        return _copy_pool[1]


def copy_flat(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """`dst[:] = src` for each pair of flat uint8 arrays of one size; at PARALLEL_COPY_BYTES
    and more in all, cut into `copy_threads()` runs of about equal bytes, one in this thread and
    the others on a pool (numpy lets the GIL go while it copies)."""
    total = sum(src.nbytes for _, src in pairs)
    n = copy_threads() if total >= PARALLEL_COPY_BYTES else 1  # no affinity call per small one
    if n < 2:
        _copy_run(pairs)
        return
    share = -(-total // n)
    runs: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    room = share
    for dst, src in pairs:
        at = 0
        while at < src.nbytes:
            if room == 0:
                runs.append([])
                room = share
            take = min(room, src.nbytes - at)
            runs[-1].append((dst[at : at + take], src[at : at + take]))
            at += take
            room -= take
    futures, here, pool = [], [runs[0]], _pool()
    for run in runs[1:]:
        try:
            futures.append(pool.submit(_copy_run, run))
        except RuntimeError:  # the interpreter is shutting down: no pool takes new work
            here.append(run)
    try:
        for run in here:
            _copy_run(run)
    finally:  # returns or raises only once no pool thread still writes into the slot
        concurrent.futures.wait(futures)
    for f in futures:
        f.result()


def _copy_run(run: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in run:
        np.copyto(dst, src)


class Packer:
    """Lays a sender's batches out in a slot; remembers the layouts of recurring batch shapes."""

    def __init__(self, slot_bytes: int, flags: int = 0, pipeline_id: int = 0, stage_id: int = 0):
        self.slot_bytes, self._fields = slot_bytes, (flags, pipeline_id, stage_id)
        self._cache: dict[tuple[Any, ...], Layout] = {}

    def __call__(
        self,
        tensors: Tensors,
        batch_size: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> tuple[list[np.ndarray], Layout]:
        """The arrays of `tensors` and their layout; TransportError if they don't fit a slot.

        A sequence is named "0", "1", ...; `batch_size` defaults to the first tensor's leading dim.
        """
        if isinstance(tensors, Mapping):
            names: tuple[str, ...] | None = tuple(tensors)
            arrays = [np.asarray(t) for t in tensors.values()]
        else:
            names, arrays = None, [np.asarray(t) for t in tensors]
        if batch_size is None:
            batch_size = arrays[0].shape[0] if arrays and arrays[0].ndim else int(bool(arrays))
        key = (names, batch_size, *[(a.dtype, a.shape) for a in arrays])
        layout = None if meta else self._cache.get(key)
        if layout is None:
            names = names or tuple(str(i) for i in range(len(arrays)))
            layout = self._lay_out(names, arrays, batch_size, meta)
            if not meta:
                if len(self._cache) >= CACHED_LAYOUTS:
                    self._cache.clear()
                self._cache[key] = layout
        return arrays, layout

    def _lay_out(
        self,
        names: tuple[str, ...],
        arrays: list[np.ndarray],
        batch_size: int,
        meta: Mapping[str, Any] | None,
    ) -> Layout:
        entries, offset = [], 0
        for name, a in zip(names, arrays, strict=True):
            try:
                code = DType.of(a.dtype)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            entries.append(TensorEntry(name, code, a.shape, offset))
            offset += -(-a.nbytes // ALIGN) * ALIGN
        nbytes = entries[-1].offset + arrays[-1].nbytes if arrays else 0
        if nbytes > self.slot_bytes:
            sizes = ", ".join(f"{n}: {a.nbytes}" for n, a in zip(names, arrays, strict=True))
            raise TransportError(
                f"a batch of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot ({sizes})"
            )
        dtype, shape = DType.NONE, ()
        # A lone tensor also goes into the fixed header, where a NIC parser can see it.
        if len(arrays) == 1 and 1 <= arrays[0].ndim <= 5 and arrays[0].shape[0] == batch_size:
            dtype, shape = DType(entries[0].dtype), arrays[0].shape[1:]
        blob = encode_meta(DataMeta(tuple(entries), dict(meta or {})))
        flags, pipeline_id, stage_id = self._fields
        header = Header(
            Kind.DATA,
            flags,
            pipeline_id,
            stage_id,
            0,
            0,
            batch_size,
            len(blob),
            nbytes,
            dtype,
            shape,
        )
        return Layout(tuple(e.offset for e in entries), nbytes, header.pack(blob) + blob)


class Unpacker:
    """Turns a receiver's DATA frames into Deliveries of views into its ring."""

    def __init__(self, ring: np.ndarray, slot_bytes: int) -> None:
        self.ring, self.slot_bytes = ring, slot_bytes
        self.slots = len(ring) // stride(slot_bytes)
        self._cache: dict[
            bytes, tuple[list[tuple[str, np.dtype, tuple[int, ...], int, int]], dict]
        ] = {}

    def __call__(self, header: Header, meta: bytes) -> Delivery:
        """The Delivery a DATA frame announces (before its payload arrives); FrameError if it lies."""
        if header.slot >= self.slots:
            raise FrameError(
                f"malformed frame: slot: {header.slot}, the ring has {self.slots} slots"
            )
        if header.payload_len > self.slot_bytes:
            raise FrameError(
                f"malformed frame: payload_len: {header.payload_len} > slot of {self.slot_bytes}"
            )
        cached = self._cache.get(meta)
        if cached is None:
            cached = self._parse(meta)
            if len(self._cache) >= CACHED_LAYOUTS:
                self._cache.clear()
            self._cache[meta] = cached
        entries, user = cached
        base = header.slot * stride(self.slot_bytes)
        tensors = {}
        for name, dt, shape, offset, end in entries:
            if end > header.payload_len:
                raise FrameError(
                    f"malformed frame: meta: tensor {name!r} ends at {end}, "
                    f"past payload_len {header.payload_len}"
                )
            tensors[name] = self.ring[base + offset : base + end].view(dt).reshape(shape)
        return Delivery(header.slot, header.request_id, header.batch_size, tensors, dict(user))

    @staticmethod
    def _parse(meta: bytes) -> tuple[list[tuple[str, np.dtype, tuple[int, ...], int, int]], dict]:
        data = decode_meta(meta, DataMeta)
        entries = []
        for e in data.tensors:
            if e.dtype not in _TENSOR_DTYPES:
                raise FrameError(
                    f"malformed frame: meta: tensor {e.name!r} has dtype code {e.dtype}"
                )
            # numpy refuses a shape whose dims (zeros aside) multiply past its index range,
            # even for an empty array: bound them too.
            nonzero = math.prod(d for d in e.shape if d)
            if min(e.shape, default=0) < 0 or len(e.shape) > 32 or nonzero > 2**48 or e.offset < 0:
                raise FrameError(
                    f"malformed frame: meta: tensor {e.name!r} has shape {e.shape}, offset {e.offset}"
                )
            dt = DType(e.dtype).numpy
            entries.append(
                (e.name, dt, e.shape, e.offset, e.offset + math.prod(e.shape) * dt.itemsize)
            )
        if len({e[0] for e in entries}) != len(entries):
            raise FrameError("malformed frame: meta: two tensors share a name")
        return entries, data.user


class Ledger:
    """A receiver's slots: which hold an announced batch, and the Delivery recv handed out."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy: set[int] = set()  # announced and not released yet
        self.held: dict[int, Delivery] = {}  # of those, the ones recv handed out
        self.closed = False

    def claim(self, header: Header) -> None:
        """Mark a DATA frame's slot busy; FrameError if the sender had no credit for it."""
        if header.slot in self.busy:
            raise FrameError(
                f"malformed frame: slot: DATA for slot {header.slot}, which the "
                "receiver still holds (the sender had no credit for it)"
            )
        self.busy.add(header.slot)

    def hand_out(self, delivery: Delivery) -> Delivery:
        self.held[delivery.slot] = delivery
        return delivery

    def take_back(self, delivery: Delivery) -> bool:
        """Check that `delivery` is held here and mark its slot free; False once closed."""
        if self.closed:
            return False
        if self.held.get(delivery.slot) is not delivery:
            raise ValueError(
                f"{self.name}: slot {delivery.slot} is not held by this delivery "
                "(released twice, or from another receiver)"
            )
        del self.held[delivery.slot]
        self.busy.discard(delivery.slot)
        return True

    def close(self) -> None:
        """Forget every delivery (so that the ring can be unmapped once the caller drops them)."""
        self.closed = True
        self.held.clear()
        self.busy.clear()


class Inbox(Ledger):
    """A Ledger with a queue: deliveries put by one thread, taken by recv(), then EOF or an error."""

    _EOF = object()

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._final: object | None = None

    def put(self, delivery: Delivery) -> None:
        self._queue.put(delivery)

    def empty(self) -> bool:
        return self._final is None and self._queue.empty()

    def end(self, error: BaseException | None = None) -> None:
        """No more deliveries: EOF, or `error` raised by every later recv."""
        self._queue.put(self._EOF if error is None else error)

    def get(self, timeout: float | None, asked: float | None = None) -> Delivery | None:
        """The next delivery, None after EOF; TransportError after `timeout` s (say `asked`)."""
        item = self._final
        if item is None:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                asked = timeout if asked is None else asked
                raise TransportError(f"{self.name}: no batch within {asked} s") from None
        if isinstance(item, Delivery):
            return self.hand_out(item)
        self._final = item
        if isinstance(item, BaseException):
            raise item
        return None

    def close(self, error: BaseException | None = None) -> None:
        super().close()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self.end(error or TransportError(f"{self.name} is closed"))
