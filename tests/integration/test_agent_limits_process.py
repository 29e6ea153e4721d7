"""A real agent process under the lower findings of issue #17 (7 and 8), each next to a
well-behaved client that must still be served: LOADs probing what the agent can reach, stage
names meant to bloat /metrics, an address guessing tokens, and token files that are no file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_agent_hardening import BATCH, BERT, proc_status, scrape, served, start_agent

from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.protocol import AuthMeta, HelloMeta, frame
from nicoffload.errors import AgentError, TransportError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import Kind

START_S = 60.0  # a hang bound on an agent's start-up, never a measure


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    auth.write_token(tmp_path / "token")
    return tmp_path / "token"


def loads(address: str, token: bytes, targets: list[str], stage: str = "") -> list[str]:
    """The agent's answer to a LOAD of BERT forwarding to each target."""
    plan = single_device_plan(load_pipeline(BERT), "dpu0")
    answers = []
    with AgentClient(address, token, timeout=30) as client:
        for target in targets:
            with pytest.raises(AgentError) as info:
                client.load(BERT.read_text(), plan, stage or plan.stages[0].name, target, **BATCH)
            answers.append(str(info.value).replace(target, "T"))
        assert client.alive
    return answers


def test_forward_to_cannot_probe_what_the_agent_reaches(tmp_path, token_file) -> None:
    """Targets off the client's address are refused before any connection; on it, a closed port,
    a silent peer and one answering in another protocol get the same answer, no byte echoed."""
    agent = start_agent(tmp_path, token_file, "handshake_timeout_s = 0.5\n")
    token = auth.read_token(token_file)
    held: list[socket.socket] = []
    try:
        served(agent.address, token)
        before = proc_status(agent.pid)
        elsewhere = socket.create_server(("127.0.0.2", 0))
        elsewhere.settimeout(0.5)
        closed = socket.create_server(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        closed.close()
        silent, talker = (
            socket.create_server(("127.0.0.1", 0)),
            socket.create_server(("127.0.0.1", 0)),
        )
        talker.settimeout(5)
        held += [elsewhere, silent, talker]
        far = loads(
            agent.address,
            token,
            [
                f"tcp://127.0.0.2:{elsewhere.getsockname()[1]}",
                "tcp://10.1.2.3:22",
                "tcp://db.internal:5432",
            ],
        )
        assert len(set(far)) == 1 and "not an address this agent forwards to" in far[0]
        with pytest.raises(TimeoutError):
            elsewhere.accept()  # the agent never connected there

        def banner() -> None:
            sock, _ = talker.accept()
            held.append(sock)
            sock.sendall(b"220 mail.internal ESMTP secret-banner ready " * 4)

        threading.Thread(target=banner, daemon=True).start()
        near = loads(
            agent.address,
            token,
            [
                nobody,
                f"tcp://127.0.0.1:{silent.getsockname()[1]}",
                f"tcp://127.0.0.1:{talker.getsockname()[1]}",
            ],
        )
        assert len(set(near)) == 1 and "no receiver could be opened there" in near[0], near
        assert "secret" not in near[0] and "refused" not in near[0].lower()
        served(agent.address, token)  # a well-behaved client still is
        deadline = time.monotonic() + 10  # the last client's connection thread may be ending
        while True:
            after = proc_status(agent.pid)
            grew = (after["fds"] - before["fds"], after["threads"] - before["threads"])
            if (grew[0] <= 4 and grew[1] <= 2) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert grew[0] <= 4 and grew[1] <= 2, grew
    finally:
        for s in held:
            s.close()
        assert agent.stop(timeout=15) == 0


def test_stage_names_cannot_bloat_the_metrics(tmp_path, token_file) -> None:
    agent = start_agent(tmp_path, token_file, metrics="127.0.0.1:0")
    token = auth.read_token(token_file)
    try:
        with listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 20) as rx:
            for i in range(5):
                (answer,) = loads(agent.address, token, [rx.address], stage=f"{i}" + "n" * 20_000)
                assert "expected 1 to 64 of A-Z a-z 0-9 _ . @ -" in answer
                assert len(answer) < 500
        served(agent.address, token)
        text = scrape(agent.metrics_address)
        assert "n" * 65 not in text and len(text) < 100_000
    finally:
        assert agent.stop(timeout=15) == 0


def guess(address: str, source: str) -> bytes:
    """From `source`, a login with a wrong proof; what the agent sent back before it closed."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    got = b""
    try:
        sock.connect((host, int(port)))
        ch = Channel(sock, "agent", io_timeout=5)
        ch.send(frame(Kind.HELLO, HelloMeta("guesser")))
        if ch.readable(5) and (head := ch.read_head(0)) is not None:
            got += bytes(head[1])
            ch.send(frame(Kind.AUTH, AuthMeta(auth.nonce(), b"\0" * 32)))
            while ch.readable(5) and (head := ch.read_head(0)) is not None:
                got += bytes(head[1])
    except (OSError, TransportError):
        pass  # closed (or reset) under us: what was got is the answer
    finally:
        sock.close()
    return got


def test_an_address_guessing_tokens_is_shut_out_for_a_while(tmp_path, token_file) -> None:
    config = "auth_failures = 3\nauth_failures_window_s = 60.0\nauth_block_s = 3.0\n"
    agent = start_agent(tmp_path, token_file, config)
    token = auth.read_token(token_file)
    try:
        for _ in range(3):
            assert b"wrong token" in guess(agent.address, "127.0.0.2")
        t0 = time.monotonic()
        for _ in range(20):  # now dropped at accept: no challenge, no log line each
            assert guess(agent.address, "127.0.0.2") == b""
        served(agent.address, token)  # the client's own address is not touched
        time.sleep(max(0.0, 3.5 - (time.monotonic() - t0)))
        assert b"wrong token" in guess(agent.address, "127.0.0.2")  # the block lapsed
    finally:
        assert agent.stop(timeout=15) == 0
    lines = (tmp_path / "agent.log").read_text().splitlines()
    assert sum('"auth_refused"' in line for line in lines) <= 4, lines


def agent_exit(token: Path, tmp_path: Path) -> tuple[int, str]:
    """Start an agent on `token`; its exit code and stderr (it must not start)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpu_agents.server",
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            str(token),
        ],
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    return proc.returncode, proc.stderr


def test_a_fifo_as_token_file_fails_start_up_at_once(tmp_path) -> None:
    fifo = tmp_path / "agent.token"
    os.mkfifo(fifo, 0o600)
    code, err = agent_exit(fifo, tmp_path)
    assert code == 2, err
    assert f"{fifo}:1:1: the token file is a FIFO, not a regular file" in err


def test_a_short_or_linked_token_file_fails_start_up(tmp_path) -> None:
    short = tmp_path / "short.token"
    short.write_text("0123456789abcdef")  # 16 bytes: accepted before
    short.chmod(0o600)
    code, err = agent_exit(short, tmp_path)
    assert code == 2 and "the token must be at least 32 bytes, got 16" in err, err
    link = tmp_path / "link.token"
    auth.write_token(tmp_path / "real.token")
    link.symlink_to(tmp_path / "real.token")
    code, err = agent_exit(link, tmp_path)
    assert code == 2 and "the token file is a symbolic link" in err, err
