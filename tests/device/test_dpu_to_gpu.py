"""A DPU stage feeding the GPU stage directly: the agent's outputs land in GPU memory as they
arrive (`GpuLanding` over the receiver's page-locked ring), and the run reports how.

The agent is a real `nicoffload-agent` process named by the topology as a DPU; the transports
are the ones this machine has (shm, tcp: no RDMA device here). The GPU stage (normalize) must
give the host's outputs, a killed agent's items must finish on the host and still reach the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from agent_kill import run_killing_at

import nicoffload
from nicoffload.agent import auth
from nicoffload.agent.local import LocalAgent
from nicoffload.graph import load_pipeline
from nicoffload.planner.plan import Plan, single_device_plan, stages_for
from nicoffload.samples import sample_images
from nicoffload.topology import Device, Link, Topology
from nicoffload.transport.gpudirect import PINNED

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
SPLIT = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "gpu0"}
NORM_TOL = 2e-3  # normalize on the GPU against the host: within one float16 rounding


def split_plan() -> Plan:
    stages, transfers = stages_for(PIPELINE, SPLIT)
    return Plan(PIPELINE.name, dict(SPLIT), stages, transfers, topology="test")


def topology_for(agent: LocalAgent, transport: str) -> Topology:
    devices = (
        Device("cpu", "cpu", 2, 2.0),
        Device("dpu0", "dpu", 1, 1.0, address=agent.address),
        Device("gpu0", "gpu", 1, 1.0),
    )
    links = (
        Link("dpu0", "cpu", transport, 1e9, 0.0, 0.0),
        Link("dpu0", "gpu0", transport, 1e9, 0.0, 0.0),
        Link("cpu", "gpu0", "pcie", 1e10, 0.0, 0.0),
    )
    return Topology("test", devices, links, ingress="dpu0", egress="cpu", source="test")


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [b for _, b in sample_images(300, seed=11)]


@pytest.fixture(scope="module")
def host_pixels(images) -> np.ndarray:
    plan = single_device_plan(PIPELINE, "cpu")
    result = nicoffload.run(PIPELINE, images, plan=plan)
    assert result.ok.all()
    return result.outputs["pixels"]


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "agent.token"
    auth.write_token(path)
    return path


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_dpu_stage_lands_on_the_gpu_and_matches_the_host(
    gpu, images, host_pixels, token_file, transport
):
    with LocalAgent(token_file, cores=1) as agent:
        result = nicoffload.run(
            PIPELINE,
            images,
            plan=split_plan(),
            topology=topology_for(agent, transport),
            token_file=token_file,
        )
    assert result.ok.all() and result.stats.failover is None
    diff = np.abs(result.outputs["pixels"].astype(np.float32) - host_pixels)
    assert diff.max() <= NORM_TOL
    assert result.torch()["pixels"].is_cuda
    transfer = result.stats.transfers["s0-dpu0->s1-gpu0"]
    landing = transfer["gpu_landing"]
    assert landing["destination"] == PINNED and f"a {transport} receiver" in landing["reason"]
    # every batch the agent sent was copied to the GPU, every byte of every crop
    assert landing["batches"] == transfer["batches"] >= len(images) // 64
    assert landing["bytes"] == len(images) * 224 * 224 * 3
    gpu_stage = result.stats.stages["s1-gpu0"]
    assert gpu_stage["ms_per_item"] > 0


def test_a_killed_agents_items_finish_on_the_host_and_still_reach_the_gpu(
    gpu, images, host_pixels, token_file
):
    agent = LocalAgent(token_file, cores=1)
    result = run_killing_at(
        agent,
        PIPELINE,
        images,
        150,
        plan=split_plan(),
        topology=topology_for(agent, "tcp"),
        token_file=token_file,
    )
    diff = np.abs(result.outputs["pixels"].astype(np.float32) - host_pixels)
    assert diff.max() <= NORM_TOL
    landing = result.stats.transfers["s0-dpu0->s1-gpu0"]["gpu_landing"]
    assert landing["bytes"] < len(images) * 224 * 224 * 3  # the host computed the rest
    assert result.stats.stages["s0-dpu0@host"]["ms_per_item"] > 0
