"""Which transport a split run forwards over, and a clear failure when RDMA is asked for but absent."""

from __future__ import annotations

import pytest

from nicoffload.errors import DeviceError
from nicoffload.graph import load_pipeline
from nicoffload.planner import physical
from nicoffload.planner.plan import Plan, stages_for
from nicoffload.runner import Prepared, open_front
from nicoffload.topology import Device, Link, Topology
from nicoffload.transport import verbs

PIPELINE = load_pipeline("pipelines/resnet50.yaml")
SPLIT = {"decode": "dpu0", "resize": "dpu0", "crop": "dpu0", "norm": "cpu"}


def prepared(link: str) -> Prepared:
    stages, transfers = stages_for(PIPELINE, SPLIT)
    plan = Plan(PIPELINE.name, dict(SPLIT), stages, transfers, topology="t")
    dpu = Device("dpu0", "dpu", 1, 1.0, address="127.0.0.1:9")
    topo = Topology(
        "t",
        (Device("cpu", "cpu", 1, 1.0), dpu),
        (Link("dpu0", "cpu", link, 1e9, 0.0, 0.0),),
        "dpu0",
        "cpu",
    )
    return Prepared(PIPELINE, plan, topo, token_file=None)


@pytest.mark.parametrize(
    ("link", "scheme"),
    [("tcp", "tcp"), ("shm", "shm"), ("rdma", "rdma"), ("rdma-gpudirect", "rdma")],
)
def test_the_topology_link_decides_the_transport(link, scheme):
    prep = prepared(link)
    plan = physical.complete(prep.pipeline, prep.plan, prep.topology)
    assert physical.of_stage(plan, plan.stages[0])["scheme"] == scheme
    assert plan.physical["s0-dpu0"]["slots"] == physical.RING_SLOTS


def test_an_rdma_plan_without_an_rdma_device_fails_naming_the_device():
    try:
        found = verbs.devices()
    except DeviceError:
        found = []
    if found:
        pytest.skip(f"this machine has RDMA devices: {found}")
    expected = "dpu0: the plan moves stage 's0-dpu0' outputs over rdma"
    with pytest.raises(DeviceError, match=expected), open_front(prepared("rdma")):
        pass
