"""A host session against a real agent process whose max_request_bytes is small: an image
larger than it is refused as too_large for the agent (the client never sends it) and runs on the
host instead, counted and reported; the rest of its batch is served by the agent, and the
session's next call still runs there (the connection was never closed)."""

from __future__ import annotations

import numpy as np
import pytest
from split_plans import SPLIT, agent_topology, plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """One agent for both tests: each opens its own session, and the agent serves on after
    the rows it refuses (the tests check that it does)."""
    tmp_path = tmp_path_factory.mktemp("agent")
    token = tmp_path / "agent.token"
    auth.write_token(token)
    config = tmp_path / "agent.toml"
    config.write_text(f"max_request_bytes = {LIMIT}\n")
    with LocalAgent(token, cores=1, config=config) as a:
        a.token_file = token
        yield a


def test_an_image_over_max_request_bytes_runs_on_the_host_and_the_rest_on_the_agent(agent):
    import simplejpeg

    images = [b for _, b in sample_images(6, seed=3)]
    rng = np.random.default_rng(0)
    huge = simplejpeg.encode_jpeg(rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8), 95)
    assert len(huge) > LIMIT
    batch = [*images[:3], huge, *images[3:]]
    host = single_device_plan(PIPELINE, "cpu")
    want = nicoffload.run(PIPELINE, batch, plan=host)
    assert want.ok.all()
    plan = plan_of(PIPELINE, SPLIT)
    with nicoffload.open(PIPELINE, plan, agent_topology(agent), token_file=agent.token_file) as s:
        client = s.front.client
        first = s.run(batch)
        assert first.ok.all(), first.failures
        np.testing.assert_array_equal(first.outputs["pixels"], want.outputs["pixels"])
        assert "too large for it (1 items ran stage" in (first.stats.failover or "")
        assert s.front.transfer.items == 7  # all of them through the agent's front
        second = s.run(images)  # the same connection, still on the agent
        assert second.ok.all() and second.stats.failover is None
        np.testing.assert_array_equal(
            second.outputs["pixels"], np.delete(want.outputs["pixels"], 3, 0)
        )
        assert s.front.client is client and client.alive
        assert s.front.transfer.items == 6
        assert client.stats()["errors"] == {}  # no frame error, nothing closed
    assert agent.alive()


def test_a_tensor_over_max_request_bytes_runs_on_the_host_on_the_general_path(agent):
    """Host -> DPU -> host (the general path): the host's decoded 1200x1600 image is over the
    agent's request size, so that row's DPU stage runs on the host; the others on the agent."""
    import simplejpeg

    rng = np.random.default_rng(1)
    images = [  # decoded, each well under the agent's request size
        simplejpeg.encode_jpeg(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8), 90)
        for _ in range(4)
    ]
    huge = simplejpeg.encode_jpeg(rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8), 90)
    batch = [images[0], huge, *images[1:]]
    want = nicoffload.run(PIPELINE, batch, plan=single_device_plan(PIPELINE, "cpu"))
    place = {"decode": "cpu", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}
    plan = plan_of(PIPELINE, place)
    with nicoffload.open(PIPELINE, plan, agent_topology(agent), token_file=agent.token_file) as s:
        got = s.run(batch)
        assert got.ok.all(), got.failures
        np.testing.assert_array_equal(got.outputs["pixels"], want.outputs["pixels"])
        assert "too large for it (1 items ran stage" in (got.stats.failover or "")
        again = s.run(images)
        assert again.ok.all() and again.stats.failover is None
