"""A Session: opened once (agent reached, stage loaded, receiver listening), then many calls.

The DPU is a real agent process named in the topology as a real DPU, as in test_split_run."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from split_plans import SPLIT, agent_topology, plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, single_device_plan, stages_for
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")


def split_plan() -> Plan:
    return plan_of(PIPELINE, SPLIT)


topology_for = agent_topology


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(100, seed=5)]


@pytest.fixture(scope="module")
def host_outputs(images):
    result = nicoffload.run(PIPELINE, images, plan=single_device_plan(PIPELINE, "cpu"))
    assert result.ok.all()
    return result.outputs["pixels"]


def started_agent(folder):
    token = folder / "agent.token"
    auth.write_token(token)
    with LocalAgent(token, cores=1) as a:
        a.token_file = token
        yield a


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """One agent for the module's sessions, one after another (as a DPU's agent serves them):
    each test opens and closes its own session on it; none but the one that kills its agent
    (`own_agent`) changes it for the next."""
    yield from started_agent(tmp_path_factory.mktemp("agent"))


@pytest.fixture
def own_agent(tmp_path):
    yield from started_agent(tmp_path)


def open_split(agent: LocalAgent):
    return nicoffload.open(
        PIPELINE, split_plan(), topology_for(agent), token_file=agent.token_file, workers=2
    )


def test_a_session_serves_many_calls_on_one_agent_connection_and_one_load(
    agent, images, host_outputs
):
    with open_split(agent) as session:
        client = session.front.client
        assert session.setup_s > 0
        for lo, hi in [(0, 40), (40, 100), (10, 20)]:
            result = session.run(images[lo:hi])
            assert result.ok.all() and result.stats.failover is None
            assert result.names == [str(i) for i in range(hi - lo)]  # numbered per call
            np.testing.assert_array_equal(result.outputs["pixels"], host_outputs[lo:hi])
            assert session.front.transfer.items == hi - lo  # this call's transfers only
            # and this call's kernels: the agent's and the host's stage, not the session's mean
            stages = result.stats.stages
            assert stages["s0-dpu0"]["items"] == stages["s1-cpu"]["items"] == hi - lo
            assert 1 <= result.stats.transfers["s0-dpu0->s1-cpu"]["batches"] <= hi - lo
            assert result.stats.setup_s == session.setup_s  # reported, never per item
        assert session.front.client is client and client.alive
        assert agent.alive()
        stats = client.stats()
        (loaded,) = stats["sessions"].values()  # one LOAD served every call
        assert loaded["admitted"] == 40 + 60 + 10 and stats["connections"] == 1


def test_stream_yields_a_batch_before_the_call_has_all_its_items(agent, images):
    first = threading.Event()

    def items():
        yield from images[:64]  # one full batch
        assert first.wait(30), "no batch came before the last items were given"
        yield from images[64:70]

    with open_split(agent) as session:
        got = 0
        for batch in session.stream(items()):
            first.set()
            got += len(batch)
            assert batch.ok.all()
        assert got == 70


def test_calls_submitted_together_run_in_order_and_each_returns_its_own_result(
    agent, images, host_outputs
):
    with open_split(agent) as session:
        futures = [session.submit(images[i : i + 25]) for i in (0, 25, 50, 75)]
        for i, f in zip((0, 25, 50, 75), futures, strict=True):
            result = f.result(timeout=120)
            np.testing.assert_array_equal(result.outputs["pixels"], host_outputs[i : i + 25])


def test_closing_a_session_with_a_call_in_flight_ends_that_call_with_session_closed(agent, images):
    session = open_split(agent)
    started = threading.Event()

    def slow_items():
        for i in range(100_000):
            started.set()
            yield images[i % len(images)]

    future = session.submit(slow_items())
    assert started.wait(30)
    session.close()
    with pytest.raises(nicoffload.SessionClosed):
        future.result(timeout=60)
    with pytest.raises(nicoffload.SessionClosed):
        session.run(images[:2])


def test_the_agent_dying_between_calls_fails_the_next_call_over_to_the_host(
    own_agent, images, host_outputs
):
    with open_split(own_agent) as session:
        first = session.run(images[:30])
        assert first.stats.failover is None
        own_agent.kill()
        second = session.run(images[30:80])
        assert second.ok.all()
        assert second.stats.failover is not None and "50 items" in second.stats.failover
        np.testing.assert_array_equal(second.outputs["pixels"], host_outputs[30:80])


@pytest.mark.parametrize("placement", ["split", "all-host"])
def test_a_stream_abandoned_after_its_first_batch_leaves_the_next_calls_whole(
    placement, agent, images, host_outputs
):
    plan = split_plan() if placement == "split" else single_device_plan(PIPELINE, "cpu")
    with nicoffload.open(
        PIPELINE, plan, topology_for(agent), token_file=agent.token_file, workers=2
    ) as session:
        for _ in range(3):
            for _batch in session.stream(images * 3):
                break  # the rest of this call is abandoned mid-way
            result = session.run(images[:30])
            assert result.ok.all() and result.names == [str(i) for i in range(30)]
            np.testing.assert_array_equal(result.outputs["pixels"], host_outputs[:30])


def test_a_stream_left_suspended_ends_when_its_thread_makes_another_call(agent, images):
    with open_split(agent) as session:
        held = session.stream(images)
        next(held)
        result = session.run(images[:5])  # was a deadlock: the held stream kept the lock
        assert result.ok.all()
        with pytest.raises(StopIteration):
            next(held)


def test_an_error_of_the_callers_iterator_comes_back_as_it_is_and_the_session_goes_on(
    agent, images, host_outputs
):
    class Broke(Exception):
        pass

    def items():
        yield from images[:20]
        raise Broke("the source broke")

    with open_split(agent) as session:
        with pytest.raises(Broke, match="the source broke"):
            session.run(items())
        result = session.run(images[:10])
        np.testing.assert_array_equal(result.outputs["pixels"], host_outputs[:10])


def test_an_item_too_large_for_the_transfer_runs_on_the_host_and_the_agent_keeps_serving(
    agent, tmp_path
):
    """The receiver's slots are sized from the pipeline's typical input (here 64x64), four
    times over for tensors of varying size; a photograph decoded at full size (the resize is
    not antialiased: no DCT scaling) does not fit one."""
    import simplejpeg

    path = tmp_path / "small.yaml"
    path.write_text(
        """
name: small-typical
inputs: {image: {kind: bytes, format: jpeg, typical: {height: 64, width: 64, bytes: 4000}}}
nodes:
  - {name: decode, op: decode_image, in: image}
  - {name: resize, op: resize, in: decode, params: {size: [32, 32], antialias: false}}
outputs: {small: resize}
batch: {max_size: 4, max_wait_ms: 2}
"""
    )
    pipeline = load_pipeline(path)
    rng = np.random.default_rng(1)
    little = simplejpeg.encode_jpeg(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    large = simplejpeg.encode_jpeg(rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8))
    placement = {"decode": "dpu0", "resize": "cpu"}
    stages, transfers = stages_for(pipeline, placement)
    plan = Plan(pipeline.name, placement, stages, transfers, topology="test")
    want = nicoffload.run(pipeline, [little, large, little], plan=single_device_plan(pipeline))
    with nicoffload.open(
        pipeline, plan, topology_for(agent), token_file=agent.token_file
    ) as session:
        first = session.run([little, large, little])
        assert first.ok.all()
        np.testing.assert_array_equal(first.outputs["small"], want.outputs["small"])
        assert "did not fit" in first.stats.failover and "1 items" in first.stats.failover
        second = session.run([little] * 6)  # the agent still serves the session
        assert second.ok.all() and second.stats.failover is None
        assert session.front.transfer.items == 6


def test_a_local_agent_stops_when_the_host_that_started_it_is_killed(tmp_path):
    import os
    import subprocess
    import sys
    import time

    script = """
import os, signal, sys
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
auth.write_token(sys.argv[1])
agent = LocalAgent(sys.argv[1], cores=1)
print(agent.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no stop(), no cleanup: as a host killed outright
"""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "t.token")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # it has exited (and init reaped it)
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                return  # exited, not yet reaped
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError("the orphaned agent was still running 20 s after its host died")
