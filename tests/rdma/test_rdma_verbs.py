"""rdma:// on real verbs beyond the shared contract: the immediate names the slot, credits under a
full ring, and a peer that disappears mid-transfer (killed, no goodbye) leaving nothing behind."""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import numpy as np
import pytest

from nicoffload.errors import TransportError
from nicoffload.transport import connect, listen, verbs
from nicoffload.transport.rdma import HEAD_BYTES, RdmaReceiver

ADDRESS = "rdma://127.0.0.1:0"


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class Peer:
    """The other end in a forked child: a process of its own, to kill mid-transfer, that starts
    in milliseconds (a fresh interpreter imports numpy and nicoffload for many seconds under
    QEMU's software CPU). It reports on a pipe: "up" (a sender), or its address (a receiver)."""

    def __init__(self, role: str, where: str = "-") -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never back into pytest
            code = 1
            try:
                os.close(r)
                self._run(role, where, os.fdopen(w, "w", buffering=1))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(w)
        self.lines = os.fdopen(r)

    @staticmethod
    def _run(role: str, where: str, report: Any) -> None:
        if role == "sender":
            tx = connect(where, timeout=10)
            report.write("up\n")
            while True:
                tx.send([np.ones(1 << 16, np.uint8)])
        rx = listen(ADDRESS, slots=2, slot_bytes=1 << 16)
        report.write(f"{rx.address}\n")
        rx.recv(timeout=30)  # the first batch, never released: the sender runs out of credits
        time.sleep(60)

    def kill(self) -> None:
        """SIGKILL, no goodbye; idempotent."""
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0

    def close(self) -> None:
        self.kill()
        self.lines.close()


def test_write_with_imm_lands_the_bytes_and_delivers_the_immediate() -> None:
    device = verbs.pick_device(None)
    a = verbs.Endpoint(device, send_depth=8, recv_depth=8)
    b = verbs.Endpoint(device, send_depth=8, recv_depth=8)
    try:
        src, dst = np.arange(4096, dtype=np.uint8), np.zeros(8192, np.uint8)
        src_mr, dst_mr = a.register(src, remote=False), b.register(dst, remote=True)
        a.connect(b.me)
        b.connect(a.me)
        a.write_imm(src_mr, 16, 1000, dst_mr.rkey, dst_mr.buf + 4096, 0xBEEF)
        got: list[int] = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = b.wait_recv(1.0)
        assert got == [0xBEEF]
        assert dst[4096 : 4096 + 1000].tobytes() == src[16:1016].tobytes()
        assert not dst[:4096].any() and not dst[5096:].any()
    finally:
        a.close()
        b.close()


def test_a_full_ring_blocks_the_sender_until_a_credit_returns_that_slot() -> None:
    with listen(ADDRESS, slots=4, slot_bytes=4096) as rx, connect(rx.address, timeout=5) as tx:
        sent = [tx.send([np.full(100, i, np.int32)], request_id=i) for i in range(4)]
        assert sorted(sent) == [0, 1, 2, 3]
        with pytest.raises(TransportError, match=r"no free slot within 0\.2 s"):
            tx.send([np.zeros(1)], timeout=0.2)
        got = [rx.recv(timeout=5) for _ in range(4)]
        # Each batch is where its immediate said: the slot its send returned, with its bytes.
        assert [(d.request_id, d.slot) for d in got] == list(enumerate(sent))  # type: ignore[union-attr]
        for i, d in enumerate(got):
            assert d is not None and (d.tensors["0"] == i).all()
        rx.release(got[2])  # type: ignore[arg-type]
        assert tx.send([np.full(100, 9, np.int32)], request_id=9, timeout=5) == sent[2]
        again = rx.recv(timeout=5)
        assert again is not None and again.slot == sent[2] and (again.tensors["0"] == 9).all()
        for d in (got[0], got[1], got[3], again):
            rx.release(d)  # type: ignore[arg-type]
        tx.flush(timeout=5)


def test_credits_keep_a_long_stream_going_through_a_small_ring() -> None:
    with listen(ADDRESS, slots=2, slot_bytes=1 << 16) as rx, connect(rx.address, timeout=5) as tx:
        for i in range(200):
            tx.send({"x": np.full(1000, i, np.int64)}, request_id=i, timeout=5)
            d = rx.recv(timeout=5)
            assert d is not None and d.request_id == i and (d.tensors["x"] == i).all()
            rx.release(d)
        tx.flush(timeout=5)


def test_a_head_bigger_than_its_area_is_refused_and_the_sender_stays_usable() -> None:
    with listen(ADDRESS, slots=1, slot_bytes=64) as rx, connect(rx.address, timeout=5) as tx:
        with pytest.raises(TransportError, match=f"{HEAD_BYTES}-byte head area"):
            tx.send([np.zeros(1)], meta={"big": "x" * HEAD_BYTES})
        tx.send([np.zeros(1)], timeout=5)
        assert rx.recv(timeout=5) is not None


def test_a_sender_killed_mid_transfer_fails_recv_and_the_receiver_closes_clean() -> None:
    fds = open_fds()
    rx = listen(ADDRESS, slots=2, slot_bytes=1 << 16)
    peer = Peer("sender", rx.address)
    try:
        assert peer.lines.readline().strip() == "up"
        first = rx.recv(timeout=10)
        assert first is not None and first.tensors["0"].sum() == 1 << 16
        rx.release(first)
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="disconnected without SHUTDOWN"):
            while True:
                d = rx.recv(timeout=10)
                assert d is not None
                rx.release(d)
        assert time.monotonic() - t0 < 5
    finally:
        peer.close()
        rx.close()
    assert isinstance(rx, RdmaReceiver)
    assert open_fds() == fds


def test_a_receiver_killed_mid_transfer_fails_send_and_the_sender_closes_clean() -> None:
    fds = open_fds()
    peer = Peer("receiver")
    try:
        tx = connect(peer.lines.readline().strip(), timeout=10)
        tx.send([np.ones(1 << 16, np.uint8)], timeout=5)
        tx.send([np.ones(1 << 16, np.uint8)], timeout=5)
        peer.kill()
        with pytest.raises(TransportError, match=r"closed the connection|failed"):
            tx.send([np.ones(1 << 16, np.uint8)], timeout=10)
        with pytest.raises(TransportError, match="failed earlier"):
            tx.send([np.ones(1)], timeout=1)
        tx.close()
    finally:
        peer.close()
    assert open_fds() == fds
