"""shm and tcp between real processes: bytes intact both ways, a peer killed mid-stream fails the
other side with TransportError (never a hang), and a killed receiver leaves no shared memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from nicoffload.errors import TransportError
from nicoffload.transport import connect, listen

KINDS = ["shm", "tcp"]
MiB = 1 << 20

# Child processes run these; they talk to the test through lines on stdout.
SENDER = """
import sys, numpy as np
from nicoffload.transport import connect
address, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with connect(address, timeout=10) as tx:
    print("connected", flush=True)
    for i in range(n):
        tx.send({"x": np.full(size, i % 251, np.uint8), "i": np.array([i, -i])}, request_id=i,
                timeout=30)
    tx.flush(timeout=30)
print("done", flush=True)
"""
RECEIVER = """
import sys, numpy as np
from nicoffload.transport import listen
address, slots, slot_bytes, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with listen(address, slots=slots, slot_bytes=slot_bytes) as rx:
    print(rx.address, flush=True)
    count = 0
    for d in rx:
        assert (d.tensors["x"] == d.request_id % 251).all(), d.request_id
        assert d.tensors["i"].tolist() == [d.request_id, -d.request_id]
        count += 1
        if hold == "release":
            rx.release(d)
print("received", count, flush=True)
"""


def spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def address(kind: str) -> str:
    return "tcp://127.0.0.1:0" if kind == "tcp" else f"shm://proc-{os.getpid()}-{time.time_ns()}"


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("nico.")}


def settled_segments(before: set[str]) -> set[str]:
    """The segments once those a dead process left are gone (its resource tracker unlinks
    them when it notices the death, a moment later), or after 10 s."""
    deadline = time.monotonic() + 10
    while segments() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return segments()


@pytest.mark.parametrize("kind", KINDS)
def test_batches_from_another_process_arrive_intact(kind: str, children: list) -> None:
    with listen(address(kind), slots=3, slot_bytes=2 * MiB) as rx:
        children.append(child := spawn(SENDER, rx.address, 20, MiB + 7))
        got = []
        for delivery in rx:
            assert (delivery.tensors["x"] == delivery.request_id % 251).all()
            assert delivery.tensors["i"].tolist() == [delivery.request_id, -delivery.request_id]
            got.append(delivery.request_id)
            rx.release(delivery)
        assert got == list(range(20))
    assert child.wait(10) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_batches_to_another_process_arrive_intact(kind: str, children: list) -> None:
    children.append(child := spawn(RECEIVER, address(kind), 2, 2 * MiB, "release"))
    assert child.stdout is not None
    with connect(child.stdout.readline().strip(), timeout=10) as tx:
        for i in range(20):
            tx.send(
                {"x": np.full(MiB + 7, i % 251, np.uint8), "i": np.array([i, -i])}, request_id=i
            )
        tx.flush(timeout=10)
    assert child.stdout.readline().split() == ["received", "20"]
    assert child.wait(10) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_sender_killed_mid_stream_fails_recv(kind: str, children: list) -> None:
    with listen(address(kind), slots=2, slot_bytes=65 * MiB) as rx:
        children.append(child := spawn(SENDER, rx.address, 10_000, 64 * MiB))
        assert rx.recv(timeout=10) is not None  # it is streaming; now it dies
        child.send_signal(signal.SIGKILL)
        with pytest.raises(TransportError, match=r"disconnected|lost|closed"):
            while True:
                delivery = rx.recv(timeout=10)
                assert delivery is not None
                rx.release(delivery)


@pytest.mark.parametrize("kind", KINDS)
def test_a_receiver_killed_fails_send(kind: str, children: list) -> None:
    before = segments()
    children.append(child := spawn(RECEIVER, address(kind), 2, MiB, "hold"))
    assert child.stdout is not None
    with connect(child.stdout.readline().strip(), timeout=10) as tx:
        tx.send([np.ones(1000)])
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        with pytest.raises(TransportError):
            for _ in range(3):  # the credits it still had, then the dead end
                tx.send([np.ones(1000)], timeout=10)
    assert settled_segments(before) == before


def test_a_crashed_receivers_segment_is_cleaned_up(children: list) -> None:
    """Killed before any sender mapped its ring, a receiver still leaves nothing in /dev/shm:
    the resource tracker of its process unlinks the segment when the process is gone."""
    before = segments()
    children.append(child := spawn(RECEIVER, address("shm"), 2, MiB, "hold"))
    assert child.stdout is not None
    child.stdout.readline()
    assert segments() - before  # the ring exists, with a name
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert settled_segments(before) == before
