"""A real agent process under the attacks of issue #17, each next to a well-behaved client that
must still be served: a LOAD of a YAML alias bomb, floods of idle unauthenticated connections,
and floods of idle connections to the metrics endpoint. The host's CLI shares the YAML code:
`nicoffload validate` of the same bomb exits 2 at once with bounded memory."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen

ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
TEXTS = [f"request {i}: " + "tokens " * i for i in range(4)]
BATCH = {"batch_max_size": 4, "batch_max_wait_ms": 1}


def bomb(levels: int = 10) -> str:
    """A pipeline whose node parameters hold 'billion laughs' (9^10 strings expanded)."""
    lines = ["name: bomb", "inputs: {text: {kind: text}}", "x0: &x0 [a, a, a, a, a, a, a, a, a]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]")
    lines += ["nodes:", f"  - {{name: tok, op: tokenize, in: text, params: *x{levels - 1}}}"]
    return "\n".join([*lines, "outputs: {ids: tok}", ""])


def proc_status(pid: int) -> dict[str, int]:
    """The agent's descriptors, threads and resident memory (kB), from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_kb": int(fields["VmRSS"].split()[0]),
    }


def served(address: str, token: bytes, tag: int = 0) -> None:
    """Log in, LOAD BERT's tokenizer, run a few requests: every result is the host's."""
    ref = nicoffload.run(BERT, TEXTS).outputs["input_ids"]
    plan = single_device_plan(load_pipeline(BERT), "dpu0")
    with (
        listen("tcp://127.0.0.1:0", slots=4, slot_bytes=1 << 20) as rx,
        AgentClient(address, token, timeout=10, client_name=f"good-{tag}") as client,
    ):
        client.load(BERT.read_text(), plan, plan.stages[0].name, rx.address, **BATCH)
        for i, text in enumerate(TEXTS):
            client.submit(i, {"text": text}, timeout=10)
        got = 0
        while got < len(TEXTS):
            d = rx.recv(timeout=10)
            assert d is not None and d.meta["failed"] == {}
            for row, rid in enumerate(d.meta["request_ids"]):
                np.testing.assert_array_equal(d.tensors["tok.input_ids"][row], ref[rid])
                got += 1
            rx.release(d)


class Steady(threading.Thread):
    """A well-behaved client logging in and running again and again until stopped."""

    def __init__(self, address: str, token: bytes) -> None:
        super().__init__(daemon=True)
        self.address, self.token = address, token
        self.stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                served(self.address, self.token, self.rounds)
                self.rounds += 1
        except BaseException as exc:
            self.error = exc

    def finish(self) -> int:
        self.stop.set()
        self.join(60)
        assert self.error is None, f"the well-behaved client failed: {self.error!r}"
        return self.rounds


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    auth.write_token(tmp_path / "token")
    return tmp_path / "token"


def start_agent(tmp_path: Path, token_file: Path, config: str = "", **kw) -> LocalAgent:
    path = tmp_path / "agent.toml"
    path.write_text(config)
    with open(tmp_path / "agent.log", "w") as log:
        return LocalAgent(token_file, cores=1, config=path, stderr=log.fileno(), **kw)


@pytest.fixture
def agent(tmp_path: Path, token_file: Path) -> Iterator[LocalAgent]:
    a = start_agent(tmp_path, token_file)
    yield a
    assert a.alive(), "the agent died"
    assert a.stop(timeout=15) == 0


# --- 1. YAML alias bomb ----------------------------------------------------------------------


def test_validate_of_an_alias_bomb_exits_2_at_the_alias_with_bounded_memory(tmp_path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    with open(tmp_path / "err", "w+") as err:
        # The peak of the validate itself: VmHWM of its own address space, written at exit
        # (the wait4 rusage of a child counts the forked copy of this, larger, process too).
        proc = subprocess.Popen(
            [sys.executable, "-c", _PEAK_AT_EXIT, "validate", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        hang = threading.Timer(60, os.kill, (proc.pid, signal.SIGKILL))  # a hang bound
        hang.start()
        proc.wait()
        hang.cancel()
        err.seek(0)
        message = err.read()
    assert proc.returncode == 2, message
    assert f"{path}:6:10: alias '*x2' takes the nodes added by aliases past 1000" in message
    assert "Traceback" not in message
    (peak,) = re.findall(r"^peak-kB (\d+)$", message, re.M)
    assert int(peak) < 200_000, peak  # kB; a plain validate takes ~60 MB


_PEAK_AT_EXIT = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\npeak-kB {kb}\\n")
atexit.register(peak)
from nicoffload.cli import main
sys.argv = ["nicoffload", *sys.argv[1:]]
main()
"""


def test_a_loaded_alias_bomb_is_refused_and_the_agent_keeps_serving(agent, token_file) -> None:
    token = auth.read_token(token_file)
    served(agent.address, token)
    before = proc_status(agent.pid)
    steady = Steady(agent.address, token)
    steady.start()
    plan = single_device_plan(load_pipeline(BERT), "dpu0")  # any plan: the YAML fails first
    with (
        listen("tcp://127.0.0.1:0", slots=2, slot_bytes=1 << 16) as rx,
        AgentClient(agent.address, token, timeout=10) as client,
    ):
        for _ in range(3):
            with pytest.raises(AgentError, match=r"<pipeline of the LOAD>:6:10: alias '\*x2'"):
                client.load(bomb(), plan, "s0-dpu0", rx.address, **BATCH)
        client.stats()  # the connection goes on after a failed LOAD
    assert steady.finish() >= 1
    after = proc_status(agent.pid)
    assert after["rss_kb"] - before["rss_kb"] < 100_000, (before, after)


# --- 2. pre-authentication lockout -----------------------------------------------------------


class Flood(threading.Thread):
    """`n` connections spread over the `sources` addresses that never authenticate (idle, or
    `send` then idle), each reopened as soon as the agent drops it."""

    def __init__(self, address: str, n: int, sources: list[str], send: bytes = b"") -> None:
        super().__init__(daemon=True)
        host, port = address.rsplit(":", 1)
        self.target, self.n, self.sources, self.send = (host, int(port)), n, sources, send
        self.stop = threading.Event()
        self.held = self.opened = self.reopened = 0
        self.error: BaseException | None = None

    def _open(self, source: str) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.settimeout(1.0)
            s.connect(self.target)
            if self.send:
                s.sendall(self.send)
            s.setblocking(False)
            return s
        except OSError:  # the backlog is full for a moment: try again next round
            s.close()
            return None

    def run(self) -> None:
        socks: dict[int, tuple[socket.socket, str]] = {}
        poller = select.poll()
        try:
            wanted = [self.sources[i % len(self.sources)] for i in range(self.n)]
            while not self.stop.is_set():
                failed = []
                for source in wanted:
                    s = self._open(source)
                    if s is None:
                        failed.append(source)
                        continue
                    socks[s.fileno()] = (s, source)
                    poller.register(s, select.POLLIN)
                    self.opened += 1
                wanted = failed
                self.held = len(socks)
                for fd, _ in poller.poll(20):
                    s, source = socks.pop(fd)
                    poller.unregister(fd)
                    s.close()
                    self.reopened += 1
                    wanted.append(source)
        except BaseException as exc:
            self.error = exc
        finally:
            for s, _ in socks.values():
                s.close()

    def finish(self) -> None:
        self.stop.set()
        self.join(10)
        assert self.error is None, repr(self.error)


def logins(address: str, token: bytes, n: int) -> list[str]:
    """Log in `n` times from 127.0.0.1; what each refusal said."""
    refused = []
    for i in range(n):
        try:
            with AgentClient(address, token, timeout=10, client_name=f"login-{i}") as client:
                client.stats()
        except AgentError as exc:
            refused.append(str(exc))
    return refused


def auth_log_lines(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "agent.log").read_text().splitlines()
    return [d for d in map(json.loads, lines) if d["event"] == "auth_refused"]


OTHERS = [f"127.0.0.{i}" for i in range(2, 10)]  # loopback too: 127.0.0.0/8


@pytest.mark.parametrize(
    ("n", "sources", "send"),
    [(120, OTHERS, b""), (120, OTHERS, b"N"), (40, ["127.0.0.1"], b"")],
    ids=["silent", "one-byte", "silent-from-the-clients-address"],
)
def test_idle_unauthenticated_sockets_cannot_keep_clients_out(
    tmp_path, token_file, n, sources, send
) -> None:
    """More idle sockets than the handshake pool, each reopened as it drops (so the pool stays
    full and contested): every login still succeeds, and the agent holds no more than its
    pool; the refusals are counted in a few log lines."""
    agent = start_agent(tmp_path, token_file)  # 32 handshakes at most, 8 per address
    token = auth.read_token(token_file)
    served(agent.address, token)
    base = proc_status(agent.pid)
    flood = Flood(agent.address, n, sources, send)
    flood.start()
    try:
        deadline = time.monotonic() + 20
        while flood.reopened < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flood.reopened >= n, flood.reopened  # the pool is full and contested
        assert logins(agent.address, token, 30) == []
        served(agent.address, token)
        during = proc_status(agent.pid)
    finally:
        flood.finish()
    # held at once: the handshake pool, the displaced ones winding down, never the flood
    assert during["fds"] - base["fds"] <= 32 + 16, (base, during)
    assert during["threads"] - base["threads"] <= 32 + 16, (base, during)
    assert agent.stop(timeout=15) == 0
    lines = auth_log_lines(tmp_path)
    assert sum(d.get("count", 1) for d in lines) >= n, lines  # every refusal is counted...
    assert len(lines) <= 4, lines  # ...in a few lines, not one each


# --- 3. the metrics endpoint -----------------------------------------------------------------


def scrape(address: str, token: bytes | None = None) -> str:
    req = urllib.request.Request(f"http://{address}/metrics")
    if token is not None:
        req.add_header("Authorization", "Bearer " + token.decode())
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def test_idle_metrics_connections_cannot_take_the_agents_descriptors(tmp_path, token_file) -> None:
    """200 idle connections to the metrics port, reopened as they drop: the agent holds at most
    its few metrics connections, logins and scrapes go on, and its accept loop does not spin."""
    agent = start_agent(tmp_path, token_file, metrics="127.0.0.1:0")  # 4 connections at most
    token = auth.read_token(token_file)
    served(agent.address, token)
    assert "nicoffload_agent_requests_total 4.0" in scrape(agent.metrics_address)
    base = proc_status(agent.pid)
    flood = Flood(agent.metrics_address, 200, ["127.0.0.1"])
    flood.start()
    try:
        deadline = time.monotonic() + 10
        while flood.opened < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flood.opened >= 50, flood.opened  # at least: the old server accepted slowly
        assert logins(agent.address, token, 10) == []
        served(agent.address, token)
        for _ in range(5):
            assert "nicoffload_agent_requests_total 8.0" in scrape(agent.metrics_address)
        during = proc_status(agent.pid)
    finally:
        flood.finish()
        assert agent.stop(timeout=15) == 0
    assert during["fds"] - base["fds"] <= 3 * 4 + 4, (base, during)
    assert during["threads"] - base["threads"] <= 4, (base, during)


def test_metrics_can_require_a_bearer_token(tmp_path, token_file) -> None:
    secret = tmp_path / "metrics.token"
    scrape_token = auth.write_token(secret)
    config = f'metrics_token_file = "{secret}"\n'
    agent = start_agent(tmp_path, token_file, config, metrics="127.0.0.1:0")
    try:
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(agent.metrics_address)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(agent.metrics_address, b"a wrong token, of the right size, nearly")
        assert "nicoffload_agent_connections" in scrape(agent.metrics_address, scrape_token)
    finally:
        assert agent.stop(timeout=15) == 0


def test_metrics_off_loopback_need_the_operators_opt_in(tmp_path, token_file) -> None:
    with pytest.raises(AgentError, match="code 2"):
        start_agent(tmp_path, token_file, metrics="0.0.0.0:0")
    assert "metrics_remote = true" in (tmp_path / "agent.log").read_text()
