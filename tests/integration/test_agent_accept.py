"""The agent's accept loops under injected faults: a thread that cannot start costs one
connection, failed accepts (EMFILE) back off and the next login succeeds, and a listener that
cannot go on fails the agent with exit 1 (so that systemd's Restart=on-failure fires) instead of
leaving it alive and deaf. The same back-off holds for the metrics endpoint."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from dpu_agents.config import AgentConfig
from dpu_agents.metrics_http import MetricsServer
from dpu_agents.server import Agent
from nicoffload.agent.client import AgentClient
from nicoffload.errors import AgentError, NicoffloadError

TOKEN = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def agent() -> Iterator[Agent]:
    cfg = AgentConfig(listen="127.0.0.1:0", cores=1, metrics="127.0.0.1:0", drain_timeout_s=2)
    with Agent(cfg, TOKEN) as a:
        yield a


def login(agent: Agent) -> dict:
    with AgentClient(agent.address, TOKEN, timeout=5) as client:
        return client.stats()


def failing_accept(
    monkeypatch: pytest.MonkeyPatch, listener: socket.socket, error: Callable[[], BaseException]
) -> list[float]:
    """Make `listener.accept()` raise error() while the returned list's first item is 1.0;
    the calls' times are appended to it."""
    calls = [1.0]
    real = socket.socket.accept

    def accept(self: socket.socket):
        if self is listener and calls[0]:
            calls.append(time.monotonic())
            raise error()
        return real(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    return calls


def serve_in_thread(agent: Agent) -> list[int]:
    result: list[int] = []
    threading.Thread(target=lambda: result.append(agent.serve()), daemon=True).start()
    return result


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout  # a hang bound, not a speed target
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_thread_that_cannot_start_costs_one_connection(agent, monkeypatch) -> None:
    real = threading.Thread.start
    failed = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("conn ") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    host, port = agent.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as victim:
        assert victim.recv(1) == b""  # closed by the agent, not left open
    assert failed
    assert login(agent)["connections"] == 1
    assert wait_for(lambda: agent.admission.counts() == (0, 0))  # nothing left behind
    assert agent.exit_code == 0


def test_failed_accepts_back_off_and_the_next_login_succeeds(agent, monkeypatch) -> None:
    calls = failing_accept(monkeypatch, agent._listener, lambda: OSError(errno.EMFILE, "EMFILE"))
    host, port = agent.address.rsplit(":", 1)
    waiting = socket.create_connection((host, int(port)), timeout=5)  # keeps the listener ready
    try:
        assert wait_for(lambda: len(calls) > 1)
        time.sleep(1.0)
        tries = len(calls) - 1
        calls[0] = 0.0
        # 10 ms doubling: 7 tries in the first second, not one every few microseconds (or 50 ms)
        assert 2 <= tries <= 10, tries
        assert login(agent)["connections"] >= 1
    finally:
        waiting.close()
    assert agent.exit_code == 0


def test_a_broken_listener_fails_the_agent_with_exit_1(agent, monkeypatch) -> None:
    failing_accept(monkeypatch, agent._listener, lambda: OSError(errno.EINVAL, "EINVAL"))
    result = serve_in_thread(agent)
    host, port = agent.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        assert wait_for(lambda: result == [1])


def test_an_accept_loop_that_ends_fails_the_agent_with_exit_1(monkeypatch) -> None:
    monkeypatch.setattr(Agent, "_accept_loop", lambda self: None)
    with Agent(AgentConfig(listen="127.0.0.1:0", cores=1), TOKEN) as agent:
        result = serve_in_thread(agent)
        assert wait_for(lambda: result == [1])


def test_the_metrics_endpoint_backs_off_failed_accepts_and_recovers(agent, monkeypatch) -> None:
    server = agent._http
    assert server is not None
    calls = failing_accept(monkeypatch, server.socket, lambda: OSError(errno.EMFILE, "EMFILE"))
    host, port = agent.metrics_address.rsplit(":", 1)
    waiting = socket.create_connection((host, int(port)), timeout=5)
    try:
        assert wait_for(lambda: len(calls) > 1)
        time.sleep(1.0)
        tries = len(calls) - 1
        calls[0] = 0.0
        assert 2 <= tries <= 10, tries  # prometheus_client's server: a core at 100%
        url = f"http://{agent.metrics_address}/metrics"
        assert b"nicoffload_agent_requests_total" in urllib.request.urlopen(url, timeout=5).read()
    finally:
        waiting.close()


def test_past_the_session_pool_a_client_is_told_after_it_authenticates() -> None:
    cfg = AgentConfig(listen="127.0.0.1:0", cores=1, max_connections=1)
    with Agent(cfg, TOKEN) as agent, AgentClient(agent.address, TOKEN, timeout=5) as first:
        with pytest.raises(AgentError, match=r"too many connections \(1 sessions\)"):
            AgentClient(agent.address, TOKEN, timeout=5)
        assert first.stats()["errors"] == {"too_many_connections": 1}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_metrics_port_that_cannot_be_bound_leaves_nothing_open() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        before = open_fds()
        cfg = AgentConfig(listen="127.0.0.1:0", cores=1, metrics=f"127.0.0.1:{port}")
        with pytest.raises(NicoffloadError, match=f"cannot serve metrics on 127.0.0.1:{port}") as e:
            Agent(cfg, TOKEN)
        assert open_fds() == before, (
            e.value
        )  # closed, while `e` keeps the server from the collector


def test_a_metrics_server_whose_threads_cannot_start_leaves_nothing_open(monkeypatch) -> None:
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "metrics-2":
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    before = open_fds()
    with pytest.raises(RuntimeError) as e:
        MetricsServer("127.0.0.1", 0, CollectorRegistry())
    assert open_fds() == before, e.value  # closed, while `e` keeps the server from the collector
    assert wait_for(lambda: not any(t.name.startswith("metrics-") for t in threading.enumerate()))
