"""A real agent process under the attacks of issue #17, each next to a well-behaved client that
must still be served: a LOAD of a YAML alias bomb, floods of idle unauthenticated connections,
and floods of idle connections to the metrics endpoint. The host's CLI shares the YAML code:
`nicoffload validate` of the same bomb exits 2 at once with bounded memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import nicoffload
from dpu_agents import auth
from dpu_agents.local import LocalAgent
from nicoffload.agent_client import AgentClient
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen

ROOT = Path(__file__).resolve().parents[2]
BERT = ROOT / "pipelines" / "bert.yaml"
TEXTS = [f"request {i}: " + "tokens " * i for i in range(4)]


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


BATCH = {"batch_max_size": 4, "batch_max_wait_ms": 1}


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
        proc = subprocess.Popen(
            [sys.executable, "-m", "nicoffload", "validate", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        hang = threading.Timer(60, os.kill, (proc.pid, signal.SIGKILL))  # a hang bound
        hang.start()
        _, status, usage = os.wait4(proc.pid, 0)
        hang.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        message = err.read()
    assert proc.returncode == 2, message
    assert f"{path}:6:10: alias '*x2' takes the nodes added by aliases past 1000" in message
    assert "Traceback" not in message
    assert usage.ru_maxrss < 400_000, usage.ru_maxrss  # kB: the CLI's imports, not the bomb's


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
