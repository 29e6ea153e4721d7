"""Split execution: a DPU stage on a real agent process, the rest on the host, and failover.

The agent here is a local `nicoffload-agent` process; the topology names it as a real (not
emulated) DPU, so the run connects to it exactly as it would to a BlueField's agent.
"""

from __future__ import annotations

import numpy as np
import pytest
from agent_kill import run_killing_at
from split_plans import SPLIT, agent_topology, plan_of

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.samples import sample_images

PIPELINE = load_pipeline("pipelines/resnet50.yaml")


def split_plan() -> Plan:
    return plan_of(PIPELINE, SPLIT)


topology_for = agent_topology


DISTINCT = 400


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    # the kill comes at item 700, once the agent has delivered batches (at item 300 it often
    # has not: the items handed out before its first delivery); the 300 after it, on the host
    small = [b for name, b in sample_images(DISTINCT, seed=7)]
    return (small * 3)[:1000]


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "agent.token"
    auth.write_token(path)
    return path


@pytest.fixture(scope="module")
def host_outputs(images):
    """The all-host outputs of `images`: those of its DISTINCT images, repeated as they are
    (an item's outputs are its own, whatever else its batch holds)."""
    result = nicoffload.run(PIPELINE, images[:DISTINCT], plan=Plan.from_json(_host_plan()))
    assert result.ok.all()
    pixels = result.outputs["pixels"]
    return np.concatenate([pixels] * -(-len(images) // DISTINCT))[: len(images)]


def _host_plan() -> dict:
    from nicoffload.planner.plan import single_device_plan

    return single_device_plan(PIPELINE, "cpu").to_json()


def test_a_split_run_equals_the_all_host_run_exactly(images, host_outputs, token_file):
    with LocalAgent(token_file, cores=1) as agent:
        result = nicoffload.run(
            PIPELINE,
            images[:300],
            plan=split_plan(),
            topology=topology_for(agent),
            token_file=token_file,
        )
    assert result.ok.all()
    assert result.stats.failover is None
    np.testing.assert_array_equal(result.outputs["pixels"], host_outputs[:300])
    doc = result.stats.to_json()
    dpu = doc["stages"]["s0-dpu0"]
    assert dpu["device"] == "dpu0"
    # the agent's own timing of its kernels, step by step
    assert set(dpu["steps"]) == {"decode", "resize+crop"}
    assert dpu["ms_per_item"] == pytest.approx(sum(dpu["steps"].values()), abs=1e-3)
    assert dpu["ms_per_item"] > 0 and dpu["wall_ms_per_item"] > 0
    (transfer,) = doc["transfers"].values()
    assert transfer["bytes_per_item"] == 224 * 224 * 3 and transfer["batches"] >= 300 // 64
    assert transfer["predicted_bytes_per_item"] == 224 * 224 * 3  # a crop: the size planned for


def test_killing_the_agent_mid_run_finishes_every_item_exactly_once_on_the_host(
    images, host_outputs, token_file
):
    agent = LocalAgent(token_file, cores=1)
    result = run_killing_at(
        agent,
        PIPELINE,
        images,
        700,
        plan=split_plan(),
        topology=topology_for(agent),
        token_file=token_file,
    )
    np.testing.assert_array_equal(result.outputs["pixels"], host_outputs)
    assert result.stats.stages["s0-dpu0@host"]["ms_per_item"] > 0  # the host took items back

    with LocalAgent(token_file, cores=1) as again:  # a restarted agent is used again
        rerun = nicoffload.run(
            PIPELINE,
            images[:128],
            plan=split_plan(),
            topology=topology_for(again),
            token_file=token_file,
        )
    assert rerun.stats.failover is None and rerun.ok.all()
    assert rerun.stats.transfers["s0-dpu0->s1-cpu"]["batches"] >= 2
    np.testing.assert_array_equal(rerun.outputs["pixels"], host_outputs[:128])


def test_a_dpu_stage_feeding_the_gpu_stage_directly_hands_it_every_row(
    images, host_outputs, token_file
):
    """DPU -> GPU with no host stage between: no host worker writes the GPU stage's rows, so
    each delivered row is collected as it arrives (no CUDA here: a stand-in GPU stage that
    normalizes on the host; on a GPU the rows land in device memory, tests/device)."""
    from fake_gpu import FakeGpuStage

    from nicoffload.runtime.executor import Executor
    from nicoffload.runtime.remote import open_front

    stages, transfers = stages_for(PIPELINE, {**SPLIT, "norm": "gpu0"})
    plan = Plan(PIPELINE.name, {**SPLIT, "norm": "gpu0"}, stages, transfers, topology="test")
    items = [(str(i), {"image": b}) for i, b in enumerate(images[:150])]
    with LocalAgent(token_file, cores=1) as agent:
        dpu = topology_for(agent).device("dpu0")
        with (
            open_front(PIPELINE, plan, plan.stages[0], dpu, token_file=token_file) as front,
            Executor(
                PIPELINE, plan, workers=2, front=front, gpu_stage=FakeGpuStage(PIPELINE, None)
            ) as ex,
        ):
            batches = [(b.ok.copy(), b.outputs["pixels"].copy()) for b in ex.stream(items)]
    assert front.transfer.items == len(items)  # every row came from the agent
    assert all(ok.all() for ok, _ in batches)
    np.testing.assert_array_equal(np.concatenate([p for _, p in batches]), host_outputs[:150])


def test_a_token_the_agent_refuses_is_the_users_mistake_naming_the_token_file(
    images, token_file, tmp_path
):
    from nicoffload.errors import UserError

    other = tmp_path / "other.token"
    auth.write_token(other)
    with LocalAgent(token_file, cores=1) as agent, pytest.raises(UserError) as info:
        nicoffload.run(
            PIPELINE, images[:4], plan=split_plan(), topology=topology_for(agent), token_file=other
        )
    assert info.value.exit_code == 2
    assert "refused this token" in str(info.value) and str(other) in str(info.value)
