"""A host session against a real agent process whose max_request_bytes is small: an image
larger than it fails alone as too_large (the client never sends it), the rest of its batch is
served by the agent, and the session's next call still runs there (no failover)."""

from __future__ import annotations

import numpy as np
import pytest
from split_plans import SPLIT, agent_topology, plan_of

import nicoffload
from dpu_agents import auth
from dpu_agents.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import single_device_plan
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
LIMIT = 1 << 20


@pytest.fixture
def agent(tmp_path):
    token = tmp_path / "agent.token"
    auth.write_token(token)
    config = tmp_path / "agent.toml"
    config.write_text(f"max_request_bytes = {LIMIT}\n")
    with LocalAgent(token, cores=1, config=config) as a:
        a.token_file = token
        yield a


def test_an_image_over_max_request_bytes_fails_as_too_large_and_the_rest_runs_on_the_agent(
    agent,
):
    import simplejpeg

    images = [b for _, b in sample_images(6, seed=3)]
    rng = np.random.default_rng(0)
    huge = simplejpeg.encode_jpeg(rng.integers(0, 255, (1200, 1600, 3), dtype=np.uint8), 95)
    assert len(huge) > LIMIT
    batch = [*images[:3], huge, *images[3:]]
    want = nicoffload.run(PIPELINE, images, plan=single_device_plan(PIPELINE, "cpu"))
    plan = plan_of(PIPELINE, SPLIT)
    with nicoffload.open(PIPELINE, plan, agent_topology(agent), token_file=agent.token_file) as s:
        client = s.front.client
        first = s.run(batch)
        assert first.ok.tolist() == [True] * 3 + [False] + [True] * 3
        (failure,) = first.failures
        assert (failure.index, failure.reason) == (3, "too_large")
        assert f"needs {-(-len(huge) // 8) * 8} bytes" in failure.detail
        assert f"({LIMIT})" in failure.detail
        assert first.stats.failover is None
        ok = first.outputs["pixels"][first.ok]
        np.testing.assert_array_equal(ok, want.outputs["pixels"])
        assert s.front.transfer.items == 7  # all of them through the agent, the huge one failed
        second = s.run(images)  # the same connection, still on the agent
        assert second.ok.all() and second.stats.failover is None
        np.testing.assert_array_equal(second.outputs["pixels"], want.outputs["pixels"])
        assert s.front.client is client and client.alive
        assert s.front.transfer.items == 6
        assert client.stats()["errors"] == {}  # no frame error, nothing closed
    assert agent.alive()
