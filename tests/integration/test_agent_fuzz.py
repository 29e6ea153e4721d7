"""Fuzzing a real agent process with generated frames and byte streams (random bytes, headers
with wrong magic / version / kind / lengths / dtypes / shapes / checksums, garbage metadata,
oversize and truncated frames, before and after authentication and with a stage loaded), and
with slow senders, while a well-behaved client keeps being served correctly. After login the
generated frames carry a valid MAC (so they reach the parser); tampered ones (a bit flipped
anywhere with the CRC made right, the tag dropped, forged, replayed, reflected or out of
sequence; SHUTDOWN included) must get no answer and end the connection.

The agent must answer each stream with well-formed frames (an ERROR for what it refuses) or
close the connection; it must never crash, hang, or leak threads or descriptors.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nicoffload
from dpu_agents.stagebuild import pipeline_from_text
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.agent.protocol import (
    TEXT,
    AuthMeta,
    ChallengeMeta,
    HelloMeta,
    LoadMeta,
    RequestMeta,
    frame,
)
from nicoffload.agent.protocol import request_frames as request_frames_of
from nicoffload.errors import FrameError, TransportError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import (
    CHECKED_SIZE,
    FIELD_OFFSETS,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAGIC_U32,
    VERSION,
    Header,
    Kind,
    decode_meta,
    encode_meta,
)
from nicoffload.transport.integrity import TAG_BYTES, FrameMac

ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
MAX_REQUEST = 1 << 20
TEXTS = [f"request number {i}: " + "tokens " * (i % 7) for i in range(8)]
DECODE_YAML = """name: fuzz-decode
inputs: {image: {kind: bytes, format: jpeg}}
nodes:
  - {name: decode, op: decode_image, in: image}
outputs: {pixels: decode}
batch: {max_size: 4, max_wait_ms: 1}
"""
_HEADER = struct.Struct(
    "!" + "".join({8: "B", 16: "H", 32: "I", 64: "Q"}[b] for _, b in HEADER_FIELDS)
)
FRAMES_SENT = [0]  # frames and byte streams generated, across all the fuzz tests
ANSWERS = frozenset(
    {Kind.ERROR, Kind.CHALLENGE, Kind.WELCOME, Kind.ACK, Kind.STATS, Kind.HEARTBEAT, Kind.CREDIT}
)


# --- the agent and a well-behaved client -----------------------------------------------------


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "token"
    auth.write_token(path)
    return path


@pytest.fixture(scope="module")
def agent(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    folder = tmp_path_factory.mktemp("agent-config")
    config = folder / "agent.toml"
    config.write_text(
        f"io_timeout_s = 0.5\nhandshake_timeout_s = 1.0\nidle_timeout_s = 5.0\n"
        f"max_request_bytes = {MAX_REQUEST}\nwindow = 16\ndrain_timeout_s = 5.0\n"
    )
    with open(folder / "agent.log", "w") as log:
        a = LocalAgent(token_file, cores=1, config=config, stderr=log.fileno())
    a.log_path = folder / "agent.log"  # type: ignore[attr-defined]
    yield a
    assert a.alive(), "the agent died"
    assert a.stop(timeout=15) == 0


class GoodClient(threading.Thread):
    """Submits BERT requests and checks every result while the fuzzing goes on."""

    def __init__(self, address: str, token: bytes) -> None:
        super().__init__(daemon=True)
        self.address, self.token = address, token
        self.stop = threading.Event()
        self.ref = nicoffload.run(BERT, TEXTS).outputs["input_ids"]
        self.sent = self.checked = 0
        self.error: BaseException | None = None
        self.baseline = (0, 0)  # the agent's descriptors and threads while this one is served
        self.port = 0  # its control connection's local port: the agent logs it as the peer

    def run(self) -> None:
        try:
            with (
                listen("tcp://127.0.0.1:0", slots=4, slot_bytes=1 << 20) as rx,
                AgentClient(self.address, self.token, timeout=10) as client,
            ):
                self.port = client._ch.sock.getsockname()[1]
                pipeline = load_pipeline(BERT)
                plan = single_device_plan(pipeline, "dpu0")
                client.load(
                    BERT.read_text(),
                    plan,
                    plan.stages[0].name,
                    rx.address,
                    batch_max_size=4,
                    batch_max_wait_ms=2,
                )
                while not self.stop.is_set() or self.checked < self.sent:
                    self.stop.wait(0.005)  # a steady client, not a load generator
                    while not self.stop.is_set() and self.sent - self.checked < 8:
                        client.submit(self.sent, {"text": TEXTS[self.sent % 8]}, timeout=10)
                        self.sent += 1
                    d = rx.recv(timeout=10)
                    assert d is not None and d.meta["failed"] == {}
                    for row, rid in enumerate(d.meta["request_ids"]):
                        assert rid == self.checked, (rid, self.checked)
                        np.testing.assert_array_equal(
                            d.tensors["tok.input_ids"][row], self.ref[rid % 8]
                        )
                        self.checked += 1
                    rx.release(d)
        except BaseException as exc:
            self.error = exc


@pytest.fixture(scope="module")
def good_client(agent: LocalAgent, token_file: Path) -> Iterator[GoodClient]:
    c = GoodClient(agent.address, auth.read_token(token_file))
    c.start()
    deadline = time.monotonic() + 30
    while c.checked < 8 and c.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    c.baseline = resources(agent.pid)
    yield c
    c.stop.set()
    c.join(30)
    if c.error is not None:  # what the agent said about this client
        lines = agent.log_path.read_text().splitlines()
        mine = [line for line in lines if f":{c.port}" in line][-5:]
        pytest.fail(f"the well-behaved client failed: {c.error!r}; the agent's log: {mine}")
    assert c.checked == c.sent > 8


def resources(pid: int) -> tuple[int, int]:
    threads = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Threads:")
    )
    return len(os.listdir(f"/proc/{pid}/fd")), threads


# --- generated frames ------------------------------------------------------------------------


# Strategies are built once: building them per draw costs more than the draws themselves.
_BLOB = st.binary(max_size=48)
_FIELD_INDEX = st.integers(0, len(HEADER_FIELDS) - 2)
_FIELD_VALUE = [st.integers(0, (1 << bits) - 1) for _, bits in HEADER_FIELDS]
_MUTATIONS = st.integers(0, 3)
_BIT = st.integers(0, 31)
_CUT = st.integers(0, 200)
_ID = st.integers(0, 2**64 - 1)
_META = st.one_of(
    st.none(),
    st.dictionaries(
        st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8), max_size=4
    ),
    st.just(HelloMeta("fuzz")),
    st.just(RequestMeta(("text",), (TEXT,), (0,), (0,), (3).to_bytes(4, "little"), b"")),
)


@st.composite
def raw_frame(draw: st.DrawFn, kinds: st.SearchStrategy[Kind]) -> bytes:
    """A frame whose header has up to three fields set to any value (magic, version, kind,
    lengths, dtype, ndim, shape...), a checksum that is right or not, maybe cut short."""
    kind, meta, payload = draw(kinds), draw(_BLOB), draw(_BLOB)
    fields = [MAGIC_U32, VERSION, int(kind), 0, 0, 0, 0, 1, 0, len(meta), len(payload)]
    fields += [0] * (len(HEADER_FIELDS) - len(fields))
    for _ in range(draw(_MUTATIONS)):
        i = draw(_FIELD_INDEX)
        fields[i] = draw(_FIELD_VALUE[i])
    if fields[2] == Kind.SHUTDOWN and kind != Kind.SHUTDOWN:
        fields[2] = 0  # an order this stream may not give (an authenticated SHUTDOWN)
    head = bytearray(_HEADER.pack(*fields))
    crc = zlib.crc32(meta, zlib.crc32(head[:CHECKED_SIZE]))
    if draw(st.booleans()):
        crc ^= 1 << draw(_BIT)
    head[CHECKED_SIZE:] = crc.to_bytes(4, "big")
    data = bytes(head) + meta + payload
    return data[: draw(_CUT)] if draw(st.booleans()) else data


@st.composite
def control_frame(draw: st.DrawFn, kinds: st.SearchStrategy[Kind]) -> bytes:
    """A well-formed frame of any kind whose metadata may be garbage or of the wrong type."""
    return frame(draw(kinds), draw(_META), request_id=draw(_ID))


_LIES = st.sampled_from(["none", "sum", "count", "lengths", "names", "kinds", "shape"])


@st.composite
def request_frames(draw: st.DrawFn) -> bytes:
    """One REQUEST of a batch of 1-4 items (values back to back, their lengths in the meta),
    honest or lying (lengths that do not add up, a batch_size that does not match them, a
    lengths blob of the wrong size, an input named twice, kinds that do not match, a tensor
    shape that is not its length), with wrong inputs, garbage images, tensors, or an odd id."""
    names = draw(st.lists(st.sampled_from(["image", "text", "other"]), max_size=3, unique=True))
    kinds = [draw(st.sampled_from(["bytes", "text", "tensor"])) for _ in names]
    n = draw(st.integers(1, 4))
    pick = st.binary(max_size=96) | st.just(b"\xff\xd8\xff\xe0" + bytes(40))
    items = [{k: draw(pick) for k in names} for _ in range(n)]
    for item in items:
        for k, kind in zip(names, kinds, strict=True):
            if kind == "text":
                item[k] = item[k].decode("latin-1")
            elif kind == "tensor":
                item[k] = np.frombuffer(item[k] or b"\0", np.uint8).reshape(1, -1, 1)
    first = draw(_ID) % (2**64 - 8)
    _, head, parts = next(request_frames_of(first, items, 1 << 20))
    body = b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)
    lie = draw(_LIES)
    if lie == "none":
        return head + body
    honest = decode_meta(head[HEADER_SIZE:], RequestMeta)
    lengths = np.frombuffer(honest.lengths, "<u4").tolist()
    count, codes, keys, shapes = n, honest.kinds, tuple(names), honest.shapes
    dtypes, ndims = honest.dtypes, honest.ndims
    if lie == "sum":
        lengths = [*(lengths or [0])[:-1], draw(st.integers(0, 2**32 - 1))]
    elif lie == "count":
        count = draw(st.integers(0, 2**32 - 1))
    elif lie == "lengths":
        lengths = [*lengths, draw(st.integers(0, 9))]
    elif lie == "names":
        keys = (*keys, "image") if "image" in keys else ("image", "image")
        codes, dtypes, ndims = (*codes, 0), (*dtypes, 0), (*ndims, 0)
    elif lie == "kinds":
        codes = (*codes, 1)
    elif shapes:  # a dim of 0, one past the length, or a product past 2**32
        dim = draw(st.sampled_from([0, 2**32 - 1]))
        at = draw(st.integers(0, len(shapes) // 4 - 1))
        shapes = shapes[: 4 * at] + dim.to_bytes(4, "little") + shapes[4 * at + 4 :]
    else:
        dtypes = (*dtypes[:-1], 5) if dtypes else (5,)
    meta = RequestMeta(keys, codes, dtypes, ndims, np.asarray(lengths, "<u4").tobytes(), shapes)
    blob = encode_meta(meta)
    lying = Header(
        Kind.REQUEST, request_id=first, batch_size=count, meta_len=len(blob), payload_len=len(body)
    )
    return lying.pack(blob) + blob + body


ANY_KIND = st.sampled_from(list(Kind))
# An authenticated SHUTDOWN is a legitimate order to stop: the fuzz after login leaves it out.
AFTER_LOGIN = st.sampled_from([k for k in Kind if k is not Kind.SHUTDOWN])


def streams(kinds: st.SearchStrategy[Kind]) -> st.SearchStrategy[list[bytes]]:
    one = st.one_of(raw_frame(kinds), control_frame(kinds), st.binary(max_size=200))
    return st.lists(one, min_size=1, max_size=10)


def exchange(
    address: str, data: list[bytes], *, prelude=None, deadline: float = 5.0, seal: bool = True
) -> list[Kind]:
    """Connect, run `prelude(channel)`, send the frames, half-close; the kinds of every frame
    the agent sent back before it closed. Fails if the agent neither answers nor closes. A
    prelude that logs in returns the MAC of the client's frames: each item of `data` then
    gets its tag (unless `seal` is False: the items are sent as they are)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    ch = Channel(sock, "agent", io_timeout=5)
    kinds: list[Kind] = []
    try:
        tx = prelude(ch) if prelude is not None else None
        if tx is not None and seal:
            data = [item + tx.tag([item]) for item in data]
        FRAMES_SENT[0] += len(data)
        try:
            sock.sendall(b"".join(data))  # one write: no Nagle / delayed-ACK stalls between frames
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the agent closed first: fine, we still read what it said
        end = time.monotonic() + deadline
        while True:
            assert ch.readable(max(0.0, end - time.monotonic())), "the agent hung"
            try:
                got = ch.read_head(0)
            except FrameError:
                raise  # the agent sent something malformed
            except TransportError:
                break  # closed, or reset because our unread bytes were still in its buffer
            if got is None:
                break
            assert got[0].kind in ANSWERS, got[0].kind
            kinds.append(got[0].kind)
    finally:
        ch.close()
    return kinds


def authenticate(token: bytes, keys: list | None = None):
    """A prelude that logs in; the channel then checks the agent's frames, and the prelude
    returns the MAC of the client's frames (the session's keys go into `keys`)."""

    def prelude(ch: Channel) -> FrameMac:
        ch.record()
        ch.send(frame(Kind.HELLO, HelloMeta("fuzz")))
        assert ch.readable(30), "no CHALLENGE"
        challenge = ch.read_head(0)
        nonce = decode_meta(challenge[1], ChallengeMeta).nonce
        mine = auth.nonce()
        ch.send(frame(Kind.AUTH, AuthMeta(mine, auth.client_proof(token, nonce, mine))))
        assert ch.readable(30), "no WELCOME"
        assert ch.read_head(0)[0].kind is Kind.WELCOME
        session = auth.session_keys(token, nonce, mine, ch.transcript())
        ch.secure(session.client, session.agent)
        if keys is not None:
            keys.append(session)
        return FrameMac(session.client)

    return prelude


FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@settings(FUZZ, max_examples=1000)
@given(data=streams(ANY_KIND))
def test_unauthenticated_streams_get_an_error_or_a_close(agent, good_client, data) -> None:
    kinds = exchange(agent.address, data)
    assert set(kinds) <= {Kind.CHALLENGE, Kind.ERROR}


@settings(FUZZ, max_examples=1000)
@given(data=streams(AFTER_LOGIN))
def test_authenticated_streams_get_answers_an_error_or_a_close(
    agent, good_client, token_file, data
) -> None:
    exchange(agent.address, data, prelude=authenticate(auth.read_token(token_file)))


@settings(FUZZ, max_examples=100)
@given(
    data=st.lists(
        st.one_of(request_frames(), raw_frame(AFTER_LOGIN), control_frame(AFTER_LOGIN)),
        min_size=1,
        max_size=12,
    )
)
def test_streams_into_a_loaded_stage_fail_items_or_the_connection(
    agent, good_client, token_file, data
) -> None:
    token = auth.read_token(token_file)
    pipeline_plan = single_device_plan(pipeline_from_text(DECODE_YAML), "dpu0")
    with listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 16) as rx:

        def prelude(ch: Channel) -> FrameMac:
            tx = authenticate(token)(ch)
            payload = DECODE_YAML.encode() + json.dumps(pipeline_plan.to_json()).encode()
            meta = LoadMeta(pipeline_plan.stages[0].name, rx.address, 4, 1.0, len(DECODE_YAML))
            load = frame(Kind.LOAD, meta, request_id=1, payload=len(payload)) + payload
            ch.sock.sendall(load + tx.tag([load]))
            assert ch.readable(30), "no answer to LOAD"
            assert ch.read_head(0)[0].kind is Kind.ACK
            return tx

        stop = threading.Event()

        def release_all() -> None:
            # recv with a timeout: a recv blocked for ever would keep rx.close() waiting
            while not stop.is_set():
                try:
                    d = rx.recv(timeout=0.1)
                except TransportError:
                    continue
                if d is None:
                    return
                rx.release(d)

        releaser = threading.Thread(target=release_all, daemon=True)
        releaser.start()
        try:
            exchange(agent.address, data, prelude=prelude, deadline=15.0)
        finally:
            stop.set()
            releaser.join(10)


# --- tampered authenticated frames ----------------------------------------------------------

BENIGN = st.lists(st.sampled_from([Kind.HEARTBEAT, Kind.STATS]), max_size=3)
TAMPERINGS = ("flip", "untagged", "forged", "replayed", "reflected", "skipped")
_ANSWER = {Kind.HEARTBEAT: Kind.HEARTBEAT, Kind.STATS: Kind.STATS}


def tampered(data: st.DataObject, item: bytes, before: list[bytes], tx: FrameMac, keys) -> bytes:
    """`item` as a relay might alter it: its bytes (with the CRC made right), its tag, or its
    place in the stream; what arrives is never the frame the client sent."""
    how = data.draw(st.sampled_from(TAMPERINGS if before else TAMPERINGS[:3] + TAMPERINGS[4:]))
    sealed = item + tx.tag([item])
    if how == "flip":
        out = bytearray(sealed)
        at = data.draw(st.integers(0, len(out) - 1))
        out[at] ^= 1 << data.draw(st.integers(0, 7))
        meta_len = int.from_bytes(out[FIELD_OFFSETS["meta_len"] : FIELD_OFFSETS["meta_len"] + 4])
        if not CHECKED_SIZE <= at < HEADER_SIZE and meta_len <= len(out) - HEADER_SIZE:
            crc = zlib.crc32(
                out[HEADER_SIZE : HEADER_SIZE + meta_len], zlib.crc32(out[:CHECKED_SIZE])
            )
            out[CHECKED_SIZE:HEADER_SIZE] = crc.to_bytes(4, "big")
        return bytes(out)
    if how == "untagged":
        return item
    if how == "forged":
        return item + data.draw(st.binary(min_size=TAG_BYTES, max_size=TAG_BYTES))
    if how == "replayed":  # an earlier frame again, in place of this one
        return data.draw(st.sampled_from(before))
    if how == "reflected":  # tagged as the agent's own frames are
        return item + FrameMac(keys[0].agent).tag([item])
    tx.seq += 1  # "skipped": a frame dropped on the way, so this one is out of sequence
    return item + tx.tag([item])


@settings(FUZZ, max_examples=300)
@given(
    prefix=BENIGN,
    target=st.one_of(control_frame(ANY_KIND), request_frames()),
    data=st.data(),
)
def test_tampered_authenticated_frames_get_no_answer_and_end_the_connection(
    agent, good_client, token_file, prefix, target, data
) -> None:
    """After login, frames that answer (HEARTBEAT, STATS) then one tampered frame of any kind,
    SHUTDOWN included: the agent answers the first ones, never the tampered one nor anything
    after it (an ERROR at most), and closes. The module's fixture checks it is still up."""
    keys: list = []
    login = authenticate(auth.read_token(token_file), keys)
    sent: list[bytes] = []

    def prelude(ch: Channel) -> None:
        tx = login(ch)
        for i, kind in enumerate(prefix):
            item = frame(kind, request_id=i + 1)
            sent.append(item + tx.tag([item]))
        sent.append(tampered(data, target, sent, tx, keys))

    kinds = exchange(agent.address, sent, prelude=prelude, seal=False)
    answers = [_ANSWER[k] for k in prefix]
    assert kinds[: len(answers)] == answers[: len(kinds)], kinds
    assert set(kinds[len(answers) :]) <= {Kind.ERROR}, kinds
    assert len(kinds) <= len(answers) + 1, kinds


def test_slow_and_stalled_senders_are_dropped(agent, good_client, token_file) -> None:
    """Senders stalled mid-frame, or dribbling bytes before authenticating, hold nothing long."""
    host, port = agent.address.rsplit(":", 1)
    hello = frame(Kind.HELLO, HelloMeta("slow"))
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(6)]
    for s in socks[:3]:
        s.sendall(hello[:30])  # stalls in the middle of a header
    t0 = time.monotonic()
    closed = set()
    while len(closed) < len(socks) and time.monotonic() - t0 < 5:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            if i >= 3:  # one byte every 50 ms: never stalls long, never finishes
                try:
                    s.send(hello[int((time.monotonic() - t0) * 20) % len(hello) :][:1])
                except OSError:
                    closed.add(i)
                    continue
            s.setblocking(False)
            try:
                if s.recv(4096) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.05)
    FRAMES_SENT[0] += len(socks)
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow senders still connected"
    assert time.monotonic() - t0 < 3.0  # handshake_timeout_s = 1


def test_the_agent_survived_without_leaks(agent, good_client) -> None:
    """Runs last in this module: every fuzz connection is gone and left nothing behind."""
    print(f"fuzzed: {FRAMES_SENT[0]} frames and byte streams")
    assert FRAMES_SENT[0] >= 10_000, FRAMES_SENT[0]
    fds0, threads0 = good_client.baseline
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fds, threads = resources(agent.pid)
        if fds <= fds0 and threads <= threads0:
            break
        time.sleep(0.1)
    assert agent.alive()
    assert fds <= fds0 and threads <= threads0, ((fds, threads), good_client.baseline)
