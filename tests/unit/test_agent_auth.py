"""The agent's door: only a client holding the token gets in, the agent proves itself too, and
nothing (a LOAD, a REQUEST) is accepted before authentication. Refusals are logged."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from dpu_agents.config import AgentConfig
from dpu_agents.server import Agent
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import ChallengeMeta, LoadMeta, WelcomeMeta, frame
from nicoffload.errors import AgentError, UserError
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import ErrorMeta, Kind, decode_meta

TOKEN = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def agent() -> Iterator[Agent]:
    cfg = AgentConfig(listen="127.0.0.1:0", cores=1, handshake_timeout_s=0.5)
    with Agent(cfg, TOKEN) as a:
        yield a


def raw(agent: Agent) -> Channel:
    host, port = agent.address.rsplit(":", 1)
    return Channel(socket.create_connection((host, int(port)), timeout=5), "agent", io_timeout=5)


def read_until_closed(ch: Channel) -> list[tuple[Kind, bytes]]:
    frames = []
    for _ in range(10):
        assert ch.readable(5.0), "the agent neither answered nor closed"
        got = ch.read_head(0)
        if got is None:
            return frames
        frames.append((got[0].kind, got[1]))
    raise AssertionError(f"the agent kept talking: {frames}")


def test_right_token_is_welcomed(agent: Agent) -> None:
    with AgentClient(agent.address, TOKEN, timeout=5) as client:
        assert client.alive
        assert client.agent.cores == 1
        assert client.stats()["connections"] == 1


def test_wrong_token_is_refused_and_logged(agent: Agent, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(AgentError, match="wrong token"):
        AgentClient(agent.address, b"not the token, but 32 bytes long", timeout=5)
    refusals = [r for r in caplog.records if r.getMessage() == "auth_refused"]
    assert refusals and refusals[0].fields["reason"] == "wrong token"
    assert agent.metrics.snapshot()["errors"] == {"auth": 1}


@pytest.mark.parametrize("kind", [Kind.LOAD, Kind.REQUEST, Kind.STATS, Kind.SHUTDOWN, Kind.AUTH])
def test_nothing_is_accepted_before_authentication(agent: Agent, kind: Kind) -> None:
    ch = raw(agent)
    meta = LoadMeta("s0", "tcp://127.0.0.1:1", 8, 1.0, 0) if kind is Kind.LOAD else None
    ch.send(frame(kind, meta))
    frames = read_until_closed(ch)
    assert [k for k, _ in frames] == [Kind.ERROR]
    assert "authentication failed" in decode_meta(frames[0][1], ErrorMeta).message
    assert agent.stats()["sessions"] == {}
    ch.close()


def test_silence_before_authentication_is_dropped(agent: Agent) -> None:
    ch = raw(agent)
    frames = read_until_closed(ch)  # after handshake_timeout_s, not never
    assert [k for k, _ in frames] == [Kind.ERROR]
    ch.close()


def test_client_refuses_an_agent_without_the_token() -> None:
    """An impostor that answers the handshake with a made-up proof gets no stage loaded."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        sock, _ = listener.accept()
        ch = Channel(sock, "client")
        ch.read_head(0)
        ch.send(frame(Kind.CHALLENGE, ChallengeMeta(auth.nonce(), "impostor")))
        ch.read_head(0)
        ch.send(frame(Kind.WELCOME, WelcomeMeta(b"\0" * 32, "impostor", 1, 1 << 20)))
        ch.readable(5.0)
        ch.close()

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(AgentError, match="the agent does not hold the token"):
        AgentClient(f"127.0.0.1:{listener.getsockname()[1]}", TOKEN, timeout=5)
    t.join(5)
    listener.close()


def test_token_file_must_be_private_and_long(tmp_path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("short")
    weak.chmod(0o600)
    with pytest.raises(UserError, match="at least 32 bytes"):
        auth.read_token(weak)
    shared = tmp_path / "shared"
    auth.write_token(shared)
    shared.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        auth.read_token(shared)
