"""The same bounds seen from a client of an agent in this process: forward_to refused before
connecting, and one answer whatever an allowed target does; stage names checked at LOAD; no
hostname before authentication; a batch of 4096 failed rows delivered; a session's id memory
freed on close; tokenizers by id."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from dpu_agents.config import AgentConfig
from dpu_agents.server import Agent
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import ChallengeMeta, HelloMeta, frame
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import Kind, decode_meta

TOKEN = b"0123456789abcdef0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
BERT_JSON = ROOT / "nicoffload" / "data" / "bert-base-uncased.json"
WAIT_S = 120.0  # a bound against hanging, never a measure
CONNECT_S = 0.5  # the agent's handshake_timeout_s here: how long a forward_to may take


def start(**kw) -> Agent:
    return Agent(
        AgentConfig(listen="127.0.0.1:0", cores=1, handshake_timeout_s=CONNECT_S, **kw), TOKEN
    )


@pytest.fixture
def agent() -> Iterator[Agent]:
    with start() as a:
        yield a


def load(client: AgentClient, forward_to: str, *, path: Path = BERT, stage=None, size=4):
    plan = single_device_plan(load_pipeline(path), "dpu0")
    return client.load(
        path.read_text(),
        plan,
        plan.stages[0].name if stage is None else stage,
        forward_to,
        batch_max_size=size,
        batch_max_wait_ms=20,
    )


def refusal(agent: Agent, forward_to: str) -> tuple[str, float]:
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        t0 = time.monotonic()
        with pytest.raises(AgentError) as info:
            load(client, forward_to)
        seconds = time.monotonic() - t0
        assert client.alive  # the LOAD failed, the connection goes on
    return "forward_to " + str(info.value).split("forward_to ", 1)[-1], seconds


class Peer(threading.Thread):
    """A TCP server on `host` that, to each connection, does `behaviour`; counts connections."""

    def __init__(self, behaviour: str, host: str = "127.0.0.1") -> None:
        super().__init__(daemon=True)
        self.behaviour, self.accepted, self._held = behaviour, 0, []
        self.server = socket.create_server((host, 0))
        self.server.settimeout(0.2)
        self.address = f"tcp://{host}:{self.server.getsockname()[1]}"
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                sock, _ = self.server.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.behaviour == "banner":  # more than a frame header: it is parsed as one
                sock.sendall(b"HTTP/1.1 400 Bad Request\r\nServer: secret-banner/1.0\r\n" * 3)
            if self.behaviour == "close":
                sock.close()
            else:
                self._held.append(sock)  # silent (or after its banner): never a WELCOME

    def stop(self) -> None:
        self._done.set()
        self.join(5)
        for s in (self.server, *self._held):
            s.close()


def test_forward_to_another_address_is_refused_before_connecting(agent) -> None:
    peer = Peer("silent", host="127.0.0.2")
    try:
        message, _ = refusal(agent, peer.address)
        assert "not an address this agent forwards to" in message
        assert peer.accepted == 0
    finally:
        peer.stop()


def test_an_allowed_target_that_is_no_receiver_gets_one_answer_whatever_it_does(agent) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    nobody = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # refused
    peers = [Peer(b) for b in ("silent", "banner", "close")]
    try:
        answers = [refusal(agent, t) for t in (nobody, *(p.address for p in peers))]
    finally:
        for p in peers:
            p.stop()
    messages = {
        m.replace(t, "T")
        for (m, _), t in zip(answers, [nobody, *(p.address for p in peers)], strict=True)
    }
    assert messages == {f"forward_to 'T': no receiver could be opened there within {CONNECT_S} s"}
    # each answer waits for the connect deadline: a refused port is not told apart by its speed
    assert all(seconds >= CONNECT_S * 0.9 for _, seconds in answers), answers


def test_forward_allow_lets_the_operator_name_other_receivers() -> None:
    texts = ["one", "two", "three"]
    ref = nicoffload.run(BERT, texts, plan=single_device_plan(load_pipeline(BERT), "cpu"))
    with (
        start(forward_allow=("127.0.0.2/32",)) as agent,
        listen("tcp://127.0.0.2:0", slots=2, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        load(client, rx.address)
        for i, text in enumerate(texts):
            client.submit(i, {"text": text})
        got = {}
        while len(got) < 3:
            d = rx.recv(timeout=WAIT_S)
            assert d is not None and d.meta["failed"] == {}
            got.update(
                (rid, d.tensors["tok.input_ids"][r].copy())
                for r, rid in enumerate(d.meta["request_ids"])
            )
            rx.release(d)
    np.testing.assert_array_equal(np.stack([got[i] for i in range(3)]), ref.outputs["input_ids"])


@pytest.mark.parametrize("name", ["s" * 20_000, "s0/dpu0", "s0 dpu0", "", "s\u00e9"])
def test_a_stage_name_that_would_make_a_bad_metrics_label_is_refused(agent, name) -> None:
    with (
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        with pytest.raises(AgentError, match=r"expected 1 to 64 of A-Z a-z 0-9 _ \. @ -") as info:
            load(client, rx.address, stage=name)
        assert len(str(info.value)) < 400


def test_the_challenge_says_nothing_of_the_machine(agent) -> None:
    host, port = agent.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        ch = Channel(sock, "agent", io_timeout=5)
        ch.send(frame(Kind.HELLO, HelloMeta("probe")))
        assert ch.readable(5)
        header, blob = ch.read_head(0)
        assert header.kind is Kind.CHALLENGE
        assert decode_meta(blob, ChallengeMeta).agent == ""
        assert socket.gethostname().encode() not in bytes(blob)
    with AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client:
        assert client.agent.agent == socket.gethostname()  # told once the client proved itself


def test_a_batch_of_4096_failed_rows_is_delivered_and_the_session_goes_on() -> None:
    with (
        start(window=4096, max_batch=4096) as agent,
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 24) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        plan = single_device_plan(load_pipeline(BERT), "dpu0")
        client.load(
            BERT.read_text(),
            plan,
            plan.stages[0].name,
            rx.address,
            batch_max_size=4096,
            batch_max_wait_ms=5000,
        )
        base = 1 << 40  # ids of 9 bytes each in the meta
        for i in range(4096):
            client.submit(base + i, {"image": b"wrong input " + b"x" * 200})
        d = rx.recv(timeout=WAIT_S)
        assert d is not None and d.batch_size == 4096
        failed = nicoffload.runtime.remote.failed_of(d.meta)
        assert set(failed) == set(range(base, base + 4096))
        assert {why for why, _ in failed.values()} == {"bad_request"}
        rx.release(d)
        client.submit(base + 4096, {"text": "still served"})
        d = rx.recv(timeout=WAIT_S)
        assert d is not None and d.meta["request_ids"] == [base + 4096] and not d.meta["failed"]
        rx.release(d)
        assert client.alive


def test_a_sessions_id_memory_is_constant_and_freed_when_it_closes(agent) -> None:
    with (
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        load(client, rx.address, size=1)
        (conn,) = agent.admission.sessions()
        session = conn.session
        before = len(session._seen._bits)
        for rid in (5, 1 << 50, (1 << 50) + 3):
            client.submit(rid, {"text": "x"})
        for _ in range(3):
            rx.release(rx.recv(timeout=WAIT_S))
        assert len(session._seen._bits) == before == agent.config.dedup_window // 8
    conn.thread.join(WAIT_S)
    assert len(session._seen._bits) <= 1


def test_a_tokenizer_is_loaded_by_id_from_the_operators_folder(tmp_path) -> None:
    folder = tmp_path / "tokenizers"
    folder.mkdir()
    (folder / "my-tok.json").write_bytes(BERT_JSON.read_bytes())
    pipeline = tmp_path / "bert.yaml"
    pipeline.write_text(
        BERT.read_text().replace("tokenizer: bert-base-uncased", "tokenizer: my-tok.json")
    )
    (tmp_path / "my-tok.json").write_bytes(BERT_JSON.read_bytes())  # the host's copy
    with (
        start(tokenizer_dir=str(folder)) as agent,
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        load(client, rx.address, path=pipeline)
        client.submit(1, {"text": "by id"})
        d = rx.recv(timeout=WAIT_S)
        assert d is not None and d.meta["failed"] == {}
        rx.release(d)


def test_a_tokenizer_path_is_refused_by_the_agent_without_opening_it(agent, tmp_path) -> None:
    pipeline = tmp_path / "bert.yaml"
    pipeline.write_text(
        BERT.read_text().replace("tokenizer: bert-base-uncased", f"tokenizer: {BERT_JSON}")
    )
    with (
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20) as rx,
        AgentClient(agent.address, TOKEN, timeout=WAIT_S) as client,
    ):
        with pytest.raises(AgentError, match="must be a tokenizer id on an agent") as info:
            load(client, rx.address, path=pipeline)
        assert "<pipeline of the LOAD>:6:" in str(info.value)
