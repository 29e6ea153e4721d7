"""Integrity after the handshake (issue #17, finding 6), against a real agent on loopback.

A relay between the client and the agent passes the handshake through, then alters, injects or
replays frames; another sits between the agent's sender and the host's receiver. Whatever it
does, a frame that fails its MAC is a connection error (counted as `bad_mac`): never a tensor
at the receiver, never a command to the agent, and the agent goes on serving others (after
every test a well-behaved client is served, and the agent's descriptors, threads and memory
are back within bounds of where they were). A stranger who connects to the host's receiver
first is refused, and the agent still attaches.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_agent_hardening import proc_status, served

from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import connect, listen
from nicoffload.transport.frame import (
    CHECKED_SIZE,
    FIELD_OFFSETS,
    HEADER_SIZE,
    OUT_OF_BAND,
    Header,
    Hello,
    Kind,
    encode,
)
from nicoffload.transport.integrity import TAG_BYTES, nonce

ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
Tamper = Callable[[int, int, bytes], bytes]  # (frame index, kind, frame bytes) -> bytes to pass


def passed(i: int, kind: int, frame: bytes) -> bytes:
    return frame


class Relay:
    """A frame-aware relay on loopback to `target`: the first `plain` frames each way (the
    handshake) pass untouched; each later frame (head, payload, tag) from the client goes
    through `tamper`, and from the server through `back`, which return what to pass on."""

    def __init__(
        self, target: tuple[str, int], tamper: Tamper, plain: int = 2, back: Tamper = passed
    ) -> None:
        self.target, self.tamper, self.back, self.plain = target, tamper, back, plain
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            down, _ = self.listener.accept()
            up = socket.create_connection(self.target)
            self.socks += [down, up]
            threading.Thread(target=self._forward, args=(up, down, self.back), daemon=True).start()
            self._forward(down, up, self.tamper)

    def _forward(self, src: socket.socket, dst: socket.socket, tamper: Tamper) -> None:
        with contextlib.suppress(OSError):
            for i in range(1 << 30):
                head = _exactly(src, HEADER_SIZE)
                if head is None:
                    break
                meta_len = _field(head, "meta_len", 4)
                payload = (
                    0 if _field(head, "flags", 2) & OUT_OF_BAND else _field(head, "payload_len", 8)
                )
                tag = TAG_BYTES if i >= self.plain else 0
                rest = _exactly(src, meta_len + payload + tag)
                dst.sendall(tamper(i, head[FIELD_OFFSETS["kind"]], head + (rest or b"")))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.thread.join(5)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _field(head: bytes, name: str, size: int) -> int:
    return int.from_bytes(head[FIELD_OFFSETS[name] : FIELD_OFFSETS[name] + size], "big")


def flip(frame: bytes, at: int) -> bytes:
    """`frame` with one bit flipped at byte `at`, its CRC made right again (only a MAC can
    tell)."""
    out = bytearray(frame)
    out[at] ^= 0x04
    meta_len = _field(out, "meta_len", 4)
    crc = zlib.crc32(out[HEADER_SIZE : HEADER_SIZE + meta_len], zlib.crc32(out[:CHECKED_SIZE]))
    out[CHECKED_SIZE:HEADER_SIZE] = crc.to_bytes(4, "big")
    return bytes(out)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "token"
    auth.write_token(path)
    return path


@pytest.fixture(scope="module")
def agent(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    config = tmp_path_factory.mktemp("agent-config") / "agent.toml"
    config.write_text("handshake_timeout_s = 2.0\nio_timeout_s = 2.0\n")
    a = LocalAgent(token_file, cores=1, config=config)
    yield a
    assert a.alive(), "the agent died"
    assert a.stop(timeout=15) == 0


@pytest.fixture(scope="module")
def baseline(agent: LocalAgent, token_file: Path) -> dict[str, int]:
    served(agent.address, auth.read_token(token_file))  # warm: BERT's tokenizer loaded once
    return proc_status(agent.pid)


@pytest.fixture(autouse=True)
def still_serving(agent: LocalAgent, token_file: Path, baseline: dict[str, int]) -> Iterator[None]:
    """After each attack: a well-behaved client is served, and the agent holds no more
    descriptors or threads than before it (once the attacked connection is closed), nor much
    more memory."""
    yield
    served(agent.address, auth.read_token(token_file))
    deadline = time.monotonic() + 10  # the agent closes the attacked session on its own time
    while time.monotonic() < deadline:
        now = proc_status(agent.pid)
        if now["fds"] <= baseline["fds"] + 2 and now["threads"] <= baseline["threads"] + 2:
            break
        time.sleep(0.05)
    assert now["fds"] <= baseline["fds"] + 2, (baseline, now)
    assert now["threads"] <= baseline["threads"] + 2, (baseline, now)
    assert now["rss_kb"] - baseline["rss_kb"] < 60_000, (baseline, now)


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def bad_macs(agent: LocalAgent, token: bytes) -> int:
    """The agent's count of refused frames, asked over a connection of its own (it serves)."""
    with AgentClient(agent.address, token, timeout=10) as c:
        return c.stats().get("errors", {}).get("bad_mac", 0)


def load_bert(client: AgentClient, forward_to: str) -> None:
    plan = single_device_plan(load_pipeline(BERT), "dpu0")
    client.load(
        BERT.read_text(), plan, plan.stages[0].name, forward_to,
        batch_max_size=1, batch_max_wait_ms=1,
    )  # fmt: skip


def no_delivery(rx, seconds: float = 1.5) -> None:
    """Nothing comes out of `rx` as a batch: it times out, fails, or its sender has gone."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            d = rx.recv(timeout=0.2)
        except TransportError:
            continue
        assert d is None, f"a batch came through: {d.meta}"
        return


class Armed:
    """A tamper that passes frames until armed, then applies `change` to the first frame of
    `kind` (once)."""

    def __init__(self, kind: Kind, change: Callable[[bytes], bytes]) -> None:
        self.kind, self.change, self.armed, self.done = kind, change, False, False

    def __call__(self, i: int, kind: int, frame: bytes) -> bytes:
        if self.armed and not self.done and kind == self.kind:
            self.done = True
            return self.change(frame)
        return frame


@contextlib.contextmanager
def relayed_session(agent: LocalAgent, token: bytes, tamper: Tamper, back: Tamper = passed):
    """A client through a relay, with BERT loaded and one request served end to end."""
    relay = Relay(host_port(agent.address), tamper, back=back)
    try:
        with (
            AgentClient(relay.address, token, timeout=5) as client,
            listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20, key=client.forward_key) as rx,
        ):
            load_bert(client, rx.address)
            client.submit(1, {"text": "a first request"})
            d = rx.recv(timeout=10)
            assert d is not None and d.meta["request_ids"] == [1]
            rx.release(d)
            yield client, rx
    finally:
        relay.close()


REQUEST_BYTES = {
    "header": FIELD_OFFSETS["request_id"] + 7,
    "meta": HEADER_SIZE + 4,  # a letter of the input's name: still well-formed msgpack
    "payload": -TAG_BYTES - 3,
}


@pytest.mark.parametrize("where", list(REQUEST_BYTES))
def test_an_altered_request_is_a_connection_error_and_no_tensor(agent, token_file, where) -> None:
    token = auth.read_token(token_file)
    before = bad_macs(agent, token)
    at = REQUEST_BYTES[where]
    tamper = Armed(Kind.REQUEST, lambda f: flip(f, at % len(f)))
    with relayed_session(agent, token, tamper) as (client, rx):
        tamper.armed = True
        with contextlib.suppress(AgentError):
            client.submit(2, {"text": "a request the relay alters"})
        no_delivery(rx)
        deadline = time.monotonic() + 5
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.alive, "the connection went on after a frame failed its MAC"
    assert tamper.done
    assert bad_macs(agent, token) == before + 1
    assert agent.alive()


@pytest.mark.parametrize("tag", [b"", bytes(TAG_BYTES), os.urandom(TAG_BYTES)])
def test_an_injected_shutdown_is_refused_and_the_agent_keeps_running(
    agent, token_file, tag
) -> None:
    token = auth.read_token(token_file)
    before = bad_macs(agent, token)
    shutdown = encode(Header(Kind.SHUTDOWN, request_id=99)) + tag
    tamper = Armed(Kind.HEARTBEAT, lambda f: shutdown + f)
    with relayed_session(agent, token, tamper) as (client, _):
        tamper.armed = True
        deadline = time.monotonic() + 10
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.alive
    assert tamper.done
    time.sleep(0.5)
    assert agent.alive(), "an injected SHUTDOWN stopped the agent"
    assert bad_macs(agent, token) == before + 1


def test_a_replayed_frame_is_refused(agent, token_file) -> None:
    token = auth.read_token(token_file)
    before = bad_macs(agent, token)
    tamper = Armed(Kind.STATS, lambda f: f + f)
    with relayed_session(agent, token, tamper) as (client, _):
        tamper.armed = True
        with contextlib.suppress(AgentError):
            client.stats()
        deadline = time.monotonic() + 5
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.alive
    assert tamper.done
    assert bad_macs(agent, token) == before + 1


def test_a_frame_forged_towards_the_client_kills_the_connection_and_is_never_acted_on(
    agent, token_file
) -> None:
    """The relay slips a CREDIT for 1000 requests in front of the agent's next HEARTBEAT: the
    client must not take the credits (it would outrun the agent's window); it is dead."""
    token = auth.read_token(token_file)
    credit = encode(Header(Kind.CREDIT, batch_size=1000)) + os.urandom(TAG_BYTES)
    back = Armed(Kind.HEARTBEAT, lambda f: credit + f)
    with relayed_session(agent, token, passed, back) as (client, _):
        credits = client._credits
        back.armed = True
        deadline = time.monotonic() + 10
        while client.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.alive
        assert client._credits <= credits + 1  # request 1's own credit may come; 1000 never
        with pytest.raises(AgentError, match="mac"):
            client.stats()
    assert back.done


def test_a_stranger_cannot_attach_to_the_hosts_receiver_and_the_agent_still_does(
    agent, token_file
) -> None:
    token = auth.read_token(token_file)
    with AgentClient(agent.address, token, timeout=10) as client:
        rx = listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20, key=client.forward_key)
        with rx:
            with pytest.raises(TransportError, match="authenticates its sender"):
                connect(rx.address, timeout=2)  # no key
            with pytest.raises(TransportError, match="does not hold the key"):
                connect(rx.address, timeout=2, key=os.urandom(32))
            with socket.create_connection(host_port(rx.address.removeprefix("tcp://"))) as s:
                s.sendall(encode(Header(Kind.HELLO), Hello("tcp", nonce())))
                s.settimeout(5)
                assert s.recv(HEADER_SIZE)[FIELD_OFFSETS["kind"]] == Kind.CHALLENGE
                s.sendall(os.urandom(200))  # no AUTH, garbage
                with contextlib.suppress(OSError):
                    while s.recv(1 << 16):
                        pass
            load_bert(client, rx.address)
            client.submit(1, {"text": "only the agent's sender attaches"})
            d = rx.recv(timeout=10)
            assert d is not None and d.meta["request_ids"] == [1]
            rx.release(d)
            with pytest.raises(TransportError):
                connect(rx.address, timeout=2, key=client.forward_key)  # one sender per ring


def test_an_altered_batch_on_the_data_channel_never_comes_out_as_a_tensor(
    agent, token_file
) -> None:
    token = auth.read_token(token_file)
    with AgentClient(agent.address, token, timeout=10) as client:
        rx = listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20, key=client.forward_key)
        tamper = Armed(Kind.DATA, lambda f: f[:-TAG_BYTES - 1] + bytes([f[-TAG_BYTES - 1] ^ 1]) + f[-TAG_BYTES:])  # fmt: skip
        tamper.armed = True
        relay = Relay(host_port(rx.address.removeprefix("tcp://")), tamper)
        try:
            with rx:
                load_bert(client, f"tcp://{relay.address}")
                client.submit(1, {"text": "a batch the relay alters"})
                with pytest.raises(TransportError, match="mac"):
                    while True:
                        assert rx.recv(timeout=10) is None or False, "a batch came through"
        finally:
            relay.close()
    assert tamper.done
    assert agent.alive()


@pytest.mark.parametrize("says", [b"", encode(Header(Kind.HELLO), Hello("tcp", b"n" * 32))])
def test_a_silent_stranger_at_the_receiver_does_not_keep_the_agent_out(
    agent, token_file, says
) -> None:
    """A stranger connects to the receiver first and stalls (before HELLO, or before AUTH):
    the agent's sender, connecting after it, displaces it and attaches within the agent's
    handshake_timeout_s (2 s here; the receiver would otherwise wait 10 s on the stranger)."""
    token = auth.read_token(token_file)
    with AgentClient(agent.address, token, timeout=10) as client:
        rx = listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20, key=client.forward_key)
        with rx, socket.create_connection(host_port(rx.address.removeprefix("tcp://"))) as s:
            s.sendall(says)
            time.sleep(0.2)  # the receiver is in its handshake with the stranger
            load_bert(client, rx.address)
            client.submit(1, {"text": "the agent's sender got in"})
            d = rx.recv(timeout=10)
            assert d is not None and d.meta["request_ids"] == [1]
            rx.release(d)
