"""GpuLanding: a real receiver's batches (shm, tcp) copied to the GPU from its page-locked ring,
the slot going back only once the copy has completed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from nicoffload.transport import connect, listen
from nicoffload.transport.gpu_landing import GpuLanding


def _batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows = 1 + i % 5  # varying batch sizes, so the slot layouts differ
        out.append(
            {
                "pixels": rng.integers(0, 256, (rows, 224, 224, 3), dtype=np.uint8),
                "scale": rng.standard_normal((rows, 7)).astype(np.float32),
                "ids": rng.integers(0, 30000, (rows, 128), dtype=np.int64),
            }
        )
    return out


def _address(kind: str, tmp_path) -> str:
    return f"shm://nicoffload-landing-{id(tmp_path)}" if kind == "shm" else "tcp://127.0.0.1:0"


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_every_batch_lands_on_the_gpu_byte_for_byte(gpu, kind, tmp_path):
    # A ring of 2 slots and 40 batches: the sender refills each slot as soon as it comes back,
    # so a slot given back before its copy finished would show up as a wrong batch here.
    sent = _batches(40)
    slot_bytes = max(sum(a.nbytes for a in b.values()) for b in sent) + 4096
    rx = listen(_address(kind, tmp_path), slots=2, slot_bytes=slot_bytes)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            with connect(rx.address) as tx:
                for i, b in enumerate(sent):
                    tx.send(b, request_id=i, batch_size=len(b["pixels"]))
                tx.flush(timeout=60)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    got = []
    with rx, GpuLanding(rx, gpu) as landing:
        while (d := landing.recv(timeout=60)) is not None:
            d.on(gpu.current_stream())
            got.append((d.request_id, {k: v.cpu().numpy() for k, v in d.tensors.items()}))
            assert all(v.is_cuda for v in d.tensors.values())
        assert landing.copies == len(sent)
        assert len(landing._registered) == 1  # the ring, page-locked once
    t.join(60)
    assert not errors, errors
    assert [rid for rid, _ in got] == list(range(len(sent)))
    for (_, arrays), want in zip(got, sent, strict=True):
        assert arrays.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(arrays[k], want[k])


def test_the_ring_is_page_locked_for_cuda_while_landing(gpu, tmp_path):
    cupy = gpu.cupy
    rx = listen("tcp://127.0.0.1:0", slots=3, slot_bytes=1 << 20)
    with rx, connect(rx.address) as tx:
        tx.send({"x": np.arange(1000, dtype=np.int32)})
        landing = GpuLanding(rx, gpu)
        d = landing.recv(timeout=30).wait()
        np.testing.assert_array_equal(d.tensors["x"].cpu().numpy(), np.arange(1000))
        (addr,) = landing._registered
        attrs = cupy.cuda.runtime.pointerGetAttributes(addr)
        assert attrs.type == cupy.cuda.runtime.memoryTypeHost  # registered: pinned host memory
        landing.close()
        attrs = cupy.cuda.runtime.pointerGetAttributes(addr)
        assert attrs.type != cupy.cuda.runtime.memoryTypeHost  # unregistered again
        tx.close()


def test_a_sender_waiting_for_its_slots_is_never_left_waiting(gpu):
    # The sender flushes after every batch: it waits until the receiver gave every slot back,
    # while the landing's caller is already waiting for the next batch. Large batches keep the
    # copy running when the caller comes back: the slot must be freed before it waits.
    x = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    rx = listen("tcp://127.0.0.1:0", slots=2, slot_bytes=(64 << 20) + 4096)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            with connect(rx.address) as tx:
                for i in range(4):
                    tx.send({"x": x}, request_id=i)
                    tx.flush(timeout=30)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    with rx, GpuLanding(rx, gpu) as landing:
        ids = []
        while (d := landing.recv(timeout=30)) is not None:
            ids.append(d.request_id)
            last = d
        assert ids == [0, 1, 2, 3]
        assert bool((last.tensors["x"].cpu().numpy() == x).all())
    t.join(30)
    assert not errors, errors
