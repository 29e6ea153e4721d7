"""The contract every transport keeps, run against each: the inproc double, shm and tcp.

Slots and credits, backpressure, timeouts, close, sizes from 0 bytes to 64 MiB, and no leaks.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

import numpy as np
import pytest

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport import (
    Delivery,
    Receiver,
    Sender,
    connect,
    listen,
    register_scheme,
    schemes,
)
from nicoffload.transport.frame import HEADER_SIZE, Header, Hello, Kind, decode_meta, encode

# How long a step that should happen at once may take before the test fails: generous, because
# the same contract runs under software emulation (the RDMA guest), where a 64 MiB batch takes
# seconds. It bounds a hang; it is no speed threshold.
WAIT = 60.0

TRANSPORTS = ["inproc", "shm", "tcp"]
STREAMS = ["shm", "tcp"]  # the ones with a real connection to corrupt
_names = itertools.count()
Pair = Callable[..., tuple[Sender, Receiver]]


def address(kind: str) -> str:
    if kind == "tcp":
        return "tcp://127.0.0.1:0"
    return f"{kind}://contract-{os.getpid()}-{next(_names)}"


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("nico.")}


@pytest.fixture(params=TRANSPORTS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def open_pair(kind: str) -> Iterator[Pair]:
    opened: list[Sender | Receiver] = []

    def open_(slots: int = 2, slot_bytes: int = 4096) -> tuple[Sender, Receiver]:
        rx = listen(address(kind), slots=slots, slot_bytes=slot_bytes)
        opened.append(rx)
        tx = connect(rx.address, timeout=WAIT)
        opened.append(tx)
        return tx, rx

    yield open_
    for resource in reversed(opened):
        resource.close()


@pytest.fixture
def pair(open_pair: Pair) -> tuple[Sender, Receiver]:
    return open_pair()


@pytest.fixture(scope="module")
def big() -> np.ndarray:
    return np.arange(16 << 20, dtype=np.uint32).reshape(4, -1)  # 64 MiB


def roundtrip(tx: Sender, rx: Receiver, tensors: object, **kw: object) -> dict[str, np.ndarray]:
    tx.send(tensors, **kw)  # type: ignore[arg-type]
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    return delivery.tensors


def roundtrip_delivery(tx: Sender, rx: Receiver) -> Delivery:
    tx.send([np.zeros(1)], timeout=WAIT)
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    return delivery


class InThread:
    """A call running in another thread: its result, or its exception raised here."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._outcome: list[tuple[bool, object]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,))
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self._outcome.append((True, fn()))
        except BaseException as exc:  # handed to result()
            self._outcome.append((False, exc))

    def finished(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return bool(self._outcome)

    def result(self, timeout: float) -> object:
        assert self.finished(timeout), "the call did not return"
        ok, value = self._outcome[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value


# --- bytes ------------------------------------------------------------------------------------


def test_tensors_of_every_dtype_arrive_byte_for_byte(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    rng = np.random.default_rng(0)
    names = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64",
             "float16", "float32", "float64", "bool"]  # fmt: skip
    sent = {n: rng.integers(0, 2, size=(2, 3)).astype(n) for n in names}
    got = roundtrip(tx, rx, sent)
    assert list(got) == names
    for name in names:
        assert got[name].dtype == sent[name].dtype and got[name].shape == (2, 3)
        assert got[name].tobytes() == sent[name].tobytes()


def test_request_id_batch_size_and_meta_travel_with_the_batch(
    pair: tuple[Sender, Receiver],
) -> None:
    tx, rx = pair
    tx.send([np.zeros((5, 2))], request_id=2**64 - 1, meta={"trace": "abc", "n": [1, 2]})
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    assert (delivery.request_id, delivery.batch_size) == (2**64 - 1, 5)
    assert delivery.meta == {"trace": "abc", "n": [1, 2]}
    assert list(delivery.tensors) == ["0"]


def test_non_contiguous_arrays_arrive_intact(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    a = np.arange(48, dtype=np.int16).reshape(6, 8)
    got = roundtrip(tx, rx, {"strided": a[:, ::3], "transposed": a.T})
    np.testing.assert_array_equal(got["strided"], a[:, ::3])
    np.testing.assert_array_equal(got["transposed"], a.T)


def test_zero_size_and_scalar_tensors_arrive(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    got = roundtrip(tx, rx, {"empty": np.zeros((0, 3), np.float32), "scalar": np.float64(2.5)})
    assert got["empty"].shape == (0, 3) and got["empty"].dtype == np.float32
    assert got["scalar"].shape == () and got["scalar"] == 2.5


def test_an_empty_batch_arrives(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    assert roundtrip(tx, rx, {}) == {}


def test_a_64_mib_tensor_arrives_intact(open_pair: Pair, big: np.ndarray) -> None:
    tx, rx = open_pair(slots=1, slot_bytes=big.nbytes)
    got = roundtrip(tx, rx, {"big": big})
    assert np.array_equal(got["big"], big)


def test_tensors_are_views_into_the_slot(open_pair: Pair) -> None:
    tx, rx = open_pair(slots=1)
    tx.send([np.zeros(4)])
    first = rx.recv(timeout=WAIT)
    assert first is not None
    rx.release(first)
    tx.send([np.ones(4)], timeout=WAIT)
    second = rx.recv(timeout=WAIT)
    assert second is not None
    assert np.shares_memory(first.tensors["0"], second.tensors["0"])


# --- slots and credits ------------------------------------------------------------------------


def test_a_batch_bigger_than_a_slot_is_refused_and_the_sender_stays_usable(
    pair: tuple[Sender, Receiver],
) -> None:
    tx, rx = pair
    with pytest.raises(TransportError, match="does not fit a 4096-byte slot"):
        tx.send([np.zeros(4097, np.uint8)])
    assert roundtrip(tx, rx, [np.zeros(4096, np.uint8)])["0"].nbytes == 4096


def test_a_full_ring_makes_send_time_out(pair: tuple[Sender, Receiver]) -> None:
    tx, _ = pair
    tx.send([np.zeros(1)])
    tx.send([np.zeros(1)])
    with pytest.raises(TransportError, match=r"no free slot within 0\.05 s"):
        tx.send([np.zeros(1)], timeout=0.05)


def test_release_returns_the_slot_to_the_sender(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    slots = {tx.send([np.zeros(1)]), tx.send([np.zeros(1)])}
    assert slots == {0, 1}
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    rx.release(delivery)
    assert tx.send([np.zeros(1)], timeout=WAIT) == delivery.slot


def test_released_slots_reach_the_sender_when_the_receiver_waits(open_pair: Pair) -> None:
    tx, rx = open_pair(slots=8)
    held = [roundtrip_delivery(tx, rx) for _ in range(8)]
    rx.release(held[0])  # credits may be held back a while, but not past a waiting recv:
    waiter = InThread(lambda: rx.recv(timeout=2 * WAIT))
    assert tx.send([np.ones(1)], timeout=WAIT) == held[0].slot
    assert waiter.result(5) is not None


def test_a_release_while_recv_waits_reaches_the_sender(open_pair: Pair) -> None:
    tx, rx = open_pair(slots=8)
    held = [roundtrip_delivery(tx, rx) for _ in range(8)]
    waiter = InThread(lambda: rx.recv(timeout=2 * WAIT))
    time.sleep(0.05)  # let it block
    rx.release(held[3])  # from another thread than the waiting recv
    assert tx.send([np.ones(1)], timeout=WAIT) == held[3].slot
    assert waiter.result(5) is not None


def test_a_blocked_sender_resumes_after_release(open_pair: Pair) -> None:
    tx, rx = open_pair(slots=1)
    tx.send([np.zeros(1)])
    blocked = InThread(lambda: tx.send([np.ones(1)], timeout=2 * WAIT))
    assert not blocked.finished(0.1)  # the only slot is held
    first = rx.recv(timeout=WAIT)
    assert first is not None
    rx.release(first)
    assert blocked.result(10) == first.slot
    second = rx.recv(timeout=WAIT)
    assert second is not None and second.tensors["0"][0] == 1


def test_flush_waits_until_every_batch_is_released(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    tx.send([np.zeros(1)])
    with pytest.raises(TransportError, match="1 batches still held"):
        tx.flush(timeout=0.05)
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    rx.release(delivery)
    tx.flush(timeout=WAIT)


def test_releasing_twice_is_a_usage_error(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    tx.send([np.zeros(1)])
    delivery = rx.recv(timeout=WAIT)
    assert delivery is not None
    rx.release(delivery)
    with pytest.raises(ValueError, match="released twice"):
        rx.release(delivery)


# --- timeouts, ends and close -----------------------------------------------------------------


def test_recv_times_out_with_transport_error(pair: tuple[Sender, Receiver]) -> None:
    _, rx = pair
    with pytest.raises(TransportError, match=r"no batch within 0\.05 s"):
        rx.recv(timeout=0.05)


def test_recv_returns_pending_batches_then_none_after_the_sender_closes(
    pair: tuple[Sender, Receiver],
) -> None:
    tx, rx = pair
    tx.send([np.zeros(1)])
    tx.close()
    assert rx.recv(timeout=WAIT) is not None
    assert rx.recv(timeout=WAIT) is None
    assert rx.recv(timeout=WAIT) is None


def test_iterating_a_receiver_yields_batches_until_the_sender_closes(
    pair: tuple[Sender, Receiver],
) -> None:
    tx, rx = pair
    tx.send([np.zeros(1)], request_id=1)
    tx.send([np.zeros(1)], request_id=2)
    tx.close()
    assert [d.request_id for d in rx] == [1, 2]


def test_send_after_the_receiver_closed_raises(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    rx.close()
    with pytest.raises(TransportError):
        tx.send([np.zeros(1)], timeout=WAIT)


def test_closing_the_receiver_wakes_a_blocked_sender(open_pair: Pair) -> None:
    tx, rx = open_pair(slots=1)
    tx.send([np.zeros(1)])
    blocked = InThread(lambda: tx.send([np.zeros(1)], timeout=2 * WAIT))
    rx.close()
    with pytest.raises(TransportError):
        blocked.result(10)


def test_closing_the_receiver_wakes_a_blocked_recv(pair: tuple[Sender, Receiver]) -> None:
    _, rx = pair
    blocked = InThread(lambda: rx.recv(timeout=2 * WAIT))
    rx.close()
    with pytest.raises(TransportError):
        blocked.result(10)


@pytest.mark.parametrize("timeout", [None, 10.0])
def test_closing_the_receiver_wakes_a_recv_that_no_sender_ever_reached(
    kind: str, timeout: float | None
) -> None:
    rx = listen(address(kind), slots=2, slot_bytes=64)
    blocked = InThread(lambda: rx.recv(timeout=timeout))
    assert not blocked.finished(0.05)
    closing = InThread(rx.close)
    assert closing.finished(5), "close() waits for the blocked recv"
    with pytest.raises(TransportError, match="closed"):
        blocked.result(5)


def test_use_after_close_raises(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    tx.close()
    rx.close()
    with pytest.raises(TransportError, match="closed"):
        tx.send([np.zeros(1)])
    with pytest.raises(TransportError, match="closed"):
        rx.recv(timeout=1)


def test_close_is_idempotent(pair: tuple[Sender, Receiver]) -> None:
    tx, rx = pair
    for _ in range(2):
        tx.close()
        rx.close()


def test_a_receiver_takes_one_sender(pair: tuple[Sender, Receiver]) -> None:
    _, rx = pair
    with pytest.raises(TransportError):
        connect(rx.address, timeout=2).close()


def test_connecting_where_nothing_listens_raises(kind: str) -> None:
    target = "tcp://127.0.0.1:1" if kind == "tcp" else address(kind)
    with pytest.raises(TransportError, match="cannot connect"):
        connect(target, timeout=2)


def test_an_unknown_scheme_is_refused_with_the_known_ones() -> None:
    with pytest.raises(TransportError, match="inproc, rdma, shm, tcp"):
        connect("rdmx://host:1")


def test_a_scheme_is_registered_once() -> None:
    assert {"inproc", "shm", "tcp"} <= set(schemes())
    with pytest.raises(ValueError, match="already registered"):
        register_scheme("tcp", "somewhere.else")


@pytest.mark.parametrize(("slots", "slot_bytes"), [(0, 64), ((1 << 16) + 1, 64), (1, 0)])
def test_a_ring_that_the_header_cannot_address_is_refused(slots: int, slot_bytes: int) -> None:
    with pytest.raises(ValueError, match="slots"):
        listen("inproc://never", slots=slots, slot_bytes=slot_bytes)


# --- leaks ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _tracker() -> None:
    resource_tracker.ensure_running()  # its pipe is opened once, not leaked per test


@pytest.mark.parametrize("ending", ["sender first", "receiver first", "mid-stream"])
def test_nothing_leaks(kind: str, ending: str) -> None:
    fds, segments = open_fds(), shm_segments()
    rx = listen(address(kind), slots=2, slot_bytes=1 << 16)
    tx = connect(rx.address, timeout=WAIT)
    tx.send([np.ones(1000)])
    if ending == "mid-stream":  # a delivery still held, a batch unread, both ends dropped
        tx.send([np.ones(1000)])
        assert rx.recv(timeout=WAIT) is not None
    first, second = (tx, rx) if ending == "sender first" else (rx, tx)
    first.close()
    second.close()
    assert shm_segments() == segments
    assert open_fds() == fds


def test_failed_listen_and_connect_leak_nothing(kind: str) -> None:
    fds, segments = open_fds(), shm_segments()
    with listen(address(kind), slots=1, slot_bytes=64) as rx:
        if kind != "tcp":  # the name is taken
            with pytest.raises(TransportError, match="cannot listen"):
                listen(rx.address, slots=1, slot_bytes=64)
    with pytest.raises(TransportError):
        connect(rx.address, timeout=1)
    assert shm_segments() == segments
    assert open_fds() == fds


# --- malformed frames (connection-based transports) -------------------------------------------


def raw_sender(rx: Receiver, kind: str) -> socket.socket:
    """A hand-driven sender: connect and shake hands, as the real one does."""
    if kind == "tcp":
        host, port = rx.address.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=WAIT)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect("\0nicoffload.shm." + rx.address.removeprefix("shm://"))
    sock.sendall(encode(Header(Kind.HELLO), Hello(kind)))
    welcome = sock.recv(4096)
    assert Header.unpack(welcome).kind is Kind.WELCOME
    sock.sendall(encode(Header(Kind.ACK)))
    return sock


@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"GARBAGE!" * 8, "magic"),
        (encode(Header(Kind.DATA, slot=9, flags=1), b"x"), "slot: 9"),
        (encode(Header(Kind.LOAD)), "unexpected LOAD"),
        (Header(Kind.CREDIT).pack()[:60] + b"\0\0\0\0", "checksum"),
    ],
)
def test_a_malformed_frame_fails_recv_and_closes_the_connection(
    kind: str, frame: bytes, error: str
) -> None:
    with listen(address(kind), slots=2, slot_bytes=64) as rx:
        sock = raw_sender(rx, kind)
        with sock:
            sock.sendall(frame)
            with pytest.raises(FrameError, match=error):
                rx.recv(timeout=WAIT)
            reply = sock.recv(4096)  # an ERROR frame saying why, then EOF
            assert Header.unpack(reply).kind is Kind.ERROR
            assert error.split(":")[0] in decode_meta(reply[HEADER_SIZE:])["message"]
            while reply:
                reply = sock.recv(4096)
