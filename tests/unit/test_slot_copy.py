"""A batch copied into a slot (shm, rdma staging, in-process) lands byte for byte where its
layout says, whether one thread copies it or several (a big batch is cut into runs)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from nicoffload.transport import slots
from nicoffload.transport.slots import ALIGN, Layout, copy_flat


def _layout(arrays: list[np.ndarray]) -> Layout:
    offsets, at = [], 0
    for a in arrays:
        offsets.append(at)
        at += -(-a.nbytes // ALIGN) * ALIGN
    return Layout(tuple(offsets), at, b"")


def _arrays(rng: np.random.Generator) -> list[np.ndarray]:
    out = [
        rng.integers(0, 255, (int(rng.integers(1, 400)), 37, 3), dtype=np.uint8) for _ in range(9)
    ]
    out.append(rng.standard_normal((3, 224, 224)).astype(np.float16))
    out.append(np.zeros(0, np.float32))
    out.append(rng.integers(0, 255, (50, 60, 3), dtype=np.uint8)[:, ::2])  # not contiguous
    out.append(np.array(7, np.int64))
    return out


@pytest.mark.parametrize("threshold", [1 << 40, 1, 4096])
def test_every_array_lands_where_its_layout_says(monkeypatch, threshold: int) -> None:
    monkeypatch.setattr(slots, "PARALLEL_COPY_BYTES", threshold)
    monkeypatch.setattr(slots, "copy_threads", lambda: 3)
    rng = np.random.default_rng(threshold)
    arrays = _arrays(rng)
    layout = _layout(arrays)
    slot = np.full(layout.nbytes + ALIGN, 0xAB, np.uint8)
    layout.copy_into(slot, arrays)
    for a, start in zip(arrays, layout.offsets, strict=True):
        got = slot[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        assert np.array_equal(got, a)
    assert (slot[layout.nbytes :] == 0xAB).all()  # nothing past the layout


def test_runs_are_about_equal_and_cover_every_byte(monkeypatch) -> None:
    monkeypatch.setattr(slots, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(slots, "copy_threads", lambda: 4)
    seen: list[int] = []
    real = slots._copy_run
    monkeypatch.setattr(
        slots, "_copy_run", lambda run: (seen.append(sum(s.nbytes for _, s in run)), real(run))
    )
    src = [np.arange(n, dtype=np.uint8) for n in (10, 1, 1000, 333)]
    dst = [np.zeros_like(s) for s in src]
    copy_flat(list(zip(dst, src, strict=True)))
    assert all(np.array_equal(d, s) for d, s in zip(dst, src, strict=True))
    assert sum(seen) == 1344 and len(seen) == 4 and max(seen) - min(seen) <= 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_copies_on_a_pool_of_its_own(monkeypatch) -> None:
    monkeypatch.setattr(slots, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(slots, "copy_threads", lambda: 2)
    src = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    copy_flat([(np.zeros_like(src), src)])  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the parent's pool threads are not in the child: it must not wait on them
        signal.alarm(20)  # a child that waits forever is killed: the test fails, not hangs
        dst = np.zeros_like(src)
        copy_flat([(dst, src)])
        os._exit(0 if np.array_equal(dst, src) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
