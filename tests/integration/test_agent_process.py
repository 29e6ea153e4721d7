"""The agent as a process: `Client.run` through it gives the host's results bit for bit, its
Prometheus endpoint counts the work, SIGTERM drains in-flight work then exits 0, and a killed or
hung agent is noticed by the client (EOF, or the heartbeat timeout)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.client import AgentClient
from nicoffload.agent.local import LocalAgent
from nicoffload.client import Client
from nicoffload.errors import AgentError
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.transport import listen

ROOT = Path(__file__).resolve().parents[2]
RESNET = ROOT / "pipelines" / "resnet50.yaml"
BERT = ROOT / "pipelines" / "bert.yaml"


def jpegs(n: int, scale: int = 1) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h, w = (240 + 16 * i) * scale, (320 - 8 * i) * scale
        img = rng.integers(0, 255, (h // 8, w // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
        out.append(simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=85))
    return out


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    auth.write_token(tmp_path / "token")
    return tmp_path / "token"


@pytest.fixture
def agent(token_file: Path) -> Iterator[LocalAgent]:
    a = LocalAgent(token_file, cores=1, metrics="127.0.0.1:0")
    yield a
    a.kill()


def test_client_run_through_the_agent_matches_the_host_and_is_measured(agent, token_file) -> None:
    images = [*jpegs(10), b"corrupt"]
    ref = nicoffload.run(RESNET, images)
    result = Client(agent.address, token_file).run(RESNET, images)
    np.testing.assert_array_equal(result.outputs["pixels"], ref.outputs["pixels"])
    assert result.ok.tolist() == ref.ok.tolist()
    assert [(f.index, f.reason) for f in result.failures] == [(10, ref.failures[0].reason)]
    assert result.stats.items == 11 and result.stats.errors == 1
    # measured as run --json measures a stage: the kernels' CPU time, step by step, wall beside
    (stage,) = result.stats.stages.values()
    assert stage["ms_per_item"] == pytest.approx(sum(stage["steps"].values()), abs=1e-3)
    assert stage["ms_per_item"] > 0 and stage["wall_ms_per_item"] > 0
    text = urllib.request.urlopen(f"http://{agent.metrics_address}/metrics", timeout=5).read()
    text = text.decode()
    assert "nicoffload_agent_requests_total 11.0" in text
    assert 'nicoffload_agent_stage_seconds_count{stage="s0-dpu0"} 11.0' in text
    assert f'nicoffload_agent_errors_total{{reason="{ref.failures[0].reason}"}} 1.0' in text
    assert 'nicoffload_agent_bytes_total{direction="out"}' in text
    assert agent.cores == [sorted(os.sched_getaffinity(0))[0]]


def test_sigterm_drains_in_flight_work_then_exits_0(agent, token_file) -> None:
    pipeline = load_pipeline(RESNET)
    plan = single_device_plan(pipeline, "dpu0")
    images = jpegs(24, scale=3)
    with listen("tcp://127.0.0.1:0", slots=4, slot_bytes=8 << 20) as rx:
        client = AgentClient(agent.address, auth.read_token(token_file), timeout=10)
        client.load(
            RESNET.read_text(),
            plan,
            plan.stages[0].name,
            rx.address,
            batch_max_size=4,
            batch_max_wait_ms=1,
        )
        for i, img in enumerate(images):
            client.submit(i, {"image": img})
        t0 = time.monotonic()
        while (stats := client.stats())["requests"] < 24 and time.monotonic() - t0 < 10:
            time.sleep(0.005)
        assert stats["items_ok"] < 24, "nothing was in flight: use bigger images"
        os.kill(agent.pid, signal.SIGTERM)  # every request admitted, most not yet run
        delivered: dict[int, str] = {}
        while (d := rx.recv(timeout=30)) is not None:
            for rid in d.meta["request_ids"]:
                assert rid not in delivered
                delivered[rid] = d.meta["failed"].get(rid, ["ok"])[0]
            rx.release(d)
        assert delivered == dict.fromkeys(range(24), "ok")
        # it said so first, on the control connection (the host stops submitting)
        assert client.draining == "the agent is shutting down"
        assert agent.wait_exit(30) == 0
        client.close()


def test_a_killed_agent_fails_the_client_at_once(agent, token_file) -> None:
    with AgentClient(agent.address, auth.read_token(token_file), timeout=5) as client:
        client.stats()
        agent.kill()
        t0 = time.monotonic()
        while client.alive and time.monotonic() - t0 < 30:  # a hang bound, not a speed target
            time.sleep(0.01)
        # at once: by the closed connection, not by a heartbeat going unanswered
        assert not client.alive
        with pytest.raises(AgentError, match="closed the connection"):
            client.stats()


def test_a_hung_agent_is_declared_dead_by_the_heartbeat(agent, token_file) -> None:
    with AgentClient(agent.address, auth.read_token(token_file), timeout=1.0) as client:
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while client.alive and time.monotonic() - t0 < 30:  # a hang bound
                time.sleep(0.02)
            assert not client.alive  # the connection is open: only the heartbeat can tell
            with pytest.raises(AgentError, match="no answer"):
                client.stats()
        finally:
            os.kill(agent.pid, signal.SIGCONT)
