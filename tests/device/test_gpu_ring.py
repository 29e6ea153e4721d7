"""An rdma ring in GPU memory (GPUDirect under nvidia-peermem): the allocation the NIC would
pin, and the receiver's unpacking of a slot there into CuPy views. The NIC's RDMA WRITE is
stood in for by a copy of the same bytes into the slot (no machine here has a GPU and an RDMA
device together); the registration itself is `gpudirect.register` -> `register_address`."""

from __future__ import annotations

import numpy as np

from nicoffload.transport.frame import HEADER_SIZE, Header
from nicoffload.transport.gpudirect import GpuRing
from nicoffload.transport.slots import Packer, Unpacker, slot_view, stride


def test_a_batch_written_into_a_gpu_ring_slot_unpacks_to_views_on_the_gpu(gpu):
    cupy = gpu.cupy
    slot_bytes, slots = 1 << 20, 3
    ring = GpuRing(0, slots * stride(slot_bytes))
    try:
        assert ring.array.nbytes == slots * stride(slot_bytes)
        assert ring.ptr == ring.array.data.ptr
        rng = np.random.default_rng(0)
        sent = {
            "pixels": rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8),
            "ids": rng.integers(0, 30000, (2, 128), dtype=np.int64),
        }
        arrays, layout = Packer(slot_bytes)(sent, 2, {"k": 1})
        host = np.zeros(slots * stride(slot_bytes), np.uint8)  # the sender's staging slot
        layout.copy_into(slot_view(host, 2, slot_bytes), arrays)
        start = 2 * stride(slot_bytes)
        ring.array[start : start + layout.nbytes].set(host[start : start + layout.nbytes])
        raw = bytes(layout.announce(2, 7))
        d = Unpacker(ring.array, slot_bytes)(Header.unpack(raw), raw[HEADER_SIZE:])
        assert (d.slot, d.request_id, d.batch_size, d.meta) == (2, 7, 2, {"k": 1})
        for name, want in sent.items():
            got = d.tensors[name]
            assert isinstance(got, cupy.ndarray)  # a view of the ring, on the GPU
            assert got.data.ptr >= ring.ptr and got.data.ptr < ring.ptr + ring.nbytes
            np.testing.assert_array_equal(cupy.asnumpy(got), want)
    finally:
        ring.close()
